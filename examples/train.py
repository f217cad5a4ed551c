# Scope: the Hydra entry point — train the example GPT on the stdlib byte corpus with any schedule.
#   python examples/train.py                                   # defaults: conf/train.yaml
#   python examples/train.py schedule=1f1b cluster=cpu_2 logger=csv
#   python examples/train.py -m schedule=breadth_first,depth_first
#   torchrun --nproc-per-node=4 examples/train.py              # or srun under SLURM
#   python examples/train.py checkpoint.every_n_steps=100      # then: ckpt_path=<run dir>/checkpoints/step-100.ckpt
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from datetime import datetime
from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `gpt` next to this file, also under `python -m`
from config_checks import check_config  # noqa: E402
from gpt import GPT, GPTConfig, OptimConfig, flops_per_token  # noqa: E402

from lightning_bfpp import BFPPStrategy  # noqa: E402  (also registers strategy="bfpp")
from lightning_bfpp.data import CorpusDataModule  # noqa: E402
from lightning_bfpp.metrics import PipelineMetrics  # noqa: E402

log = logging.getLogger(__name__)


def run_id(default: str) -> str:
    """One run directory for all processes of a job: launchers that start every rank themselves
    (SLURM, torchrun) name the job; otherwise the time stamp `default` (the popen launcher passes
    the parent's directory to its children)."""
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if elastic not in ("", "none"):
        return f"torchrun-{elastic}"
    return default


def output_subdir(default: str) -> str | None:
    """Only global rank 0 writes the composed config (<run dir>/.hydra) when every rank runs Hydra."""
    return default if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0" else None


def rank_suffix() -> str:
    """'' on global rank 0, '_rank<r>' elsewhere: one log file per rank when every rank runs Hydra."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    return "" if rank == "0" else f"_rank{rank}"


OmegaConf.register_new_resolver("bfpp_run_id", run_id, replace=True)
OmegaConf.register_new_resolver("bfpp_rank_suffix", rank_suffix, replace=True)
OmegaConf.register_new_resolver("bfpp_output_subdir", output_subdir, replace=True)


def from_config(cls, node: DictConfig):
    """The dataclass `cls` from the config keys that are its fields."""
    values = OmegaConf.to_container(node, resolve=True)
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def model_config(cfg: DictConfig) -> GPTConfig:
    """GPTConfig from `model.*` (the yaml may hold more keys, e.g. for the planner). Activation checkpointing
    is applied in one place: by the GPT's blocks under strategy=auto, by the strategy under bfpp
    (build_strategy), where the blocks' own is switched off so that nothing is recomputed twice."""
    model_cfg = from_config(GPTConfig, cfg.model)
    if cfg.trainer.strategy == "bfpp":
        model_cfg = dataclasses.replace(model_cfg, activation_checkpointing=False)
    return model_cfg


def world_size(cfg: DictConfig) -> int:
    return int(cfg.cluster.devices) * int(cfg.cluster.num_nodes)


def build_strategy(cfg: DictConfig):
    if cfg.trainer.strategy == "auto":
        return "auto"
    if cfg.trainer.strategy != "bfpp":
        raise ValueError(f"trainer.strategy={cfg.trainer.strategy!r}: use bfpp or auto")
    s = OmegaConf.to_container(cfg.schedule, resolve=True)
    # model.activation_checkpointing: applied by the strategy to every layer of every local stage (see model_config)
    ac = bool(cfg.model.get("activation_checkpointing", False))
    return BFPPStrategy(schedule=s.pop("name"), activation_checkpointing=ac, **s)


def build_loggers(cfg: DictConfig, run_dir: Path, run_name: str) -> list:
    name = cfg.logger.name
    if name == "none":
        return []
    if name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return [CSVLogger(save_dir=str(run_dir), name="csv")]
    if name == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        online = cfg.logger.mode == "online"
        if not online:
            os.environ["WANDB_MODE"] = "offline"
        logger = WandbLogger(
            project=cfg.logger.project, entity=cfg.logger.entity, name=cfg.logger.run_name or run_name,
            tags=list(cfg.logger.tags), save_dir=str(run_dir), offline=not online,
        )
        return [logger]
    raise ValueError(f"logger.name={name!r}: use wandb, csv or none")


def prepare_relaunch() -> None:
    """Make Lightning's popen launcher re-run THIS job in its children, in THIS job's directory.

    Lightning re-runs `sys.argv` with `hydra.run.dir=<HydraConfig run.dir>` appended. In a multirun
    (`-m a=1,2`) that would start a whole sweep in every child, in a fresh time-stamped directory;
    so the parent's argv becomes the current job's own overrides and run.dir its output directory.
    """
    hc = HydraConfig.get()
    keep, args = [], iter(sys.argv[1:])
    for arg in args:  # keep --config-name/-cn, --config-path/-cp, --config-dir/-cd (and their values)
        if arg.split("=")[0] in ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd"):
            keep.append(arg)
            if "=" not in arg:
                keep.append(next(args, ""))
    chdir = [o for o in hc.overrides.hydra if o.startswith("hydra.job.chdir=")]
    sys.argv[1:] = keep + list(hc.overrides.task) + chdir
    OmegaConf.set_readonly(hc, False)
    hc.run.dir = hc.runtime.output_dir


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> dict | None:
    check_config(cfg)  # the app's keys, before any process starts (the strategy checks its own knobs and the model)
    env_before = dict(os.environ)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    launches_children = "LOCAL_RANK" not in os.environ and not os.environ.get("SLURM_NTASKS")
    if launches_children and world_size(cfg) > 1:
        prepare_relaunch()
    try:
        return train(cfg, run_dir)
    finally:  # a multirun runs the next job in this process: leave no W&B run, process group or launcher env behind
        import torch.distributed as dist

        if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
            sys.modules["wandb"].finish()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if launches_children:
            os.environ.clear()
            os.environ.update(env_before)


def train(cfg: DictConfig, run_dir: Path) -> dict | None:
    L.seed_everything(cfg.data.seed, workers=True)
    model_cfg = model_config(cfg)
    optim = from_config(OptimConfig, cfg.optim)
    optim.betas = tuple(optim.betas)
    model = GPT(model_cfg, optim)
    data_keys = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k != "name"}
    datamodule = CorpusDataModule(**data_keys)

    s = cfg.schedule
    run_name = f"{s.name}-pp{s.pipeline_parallel}-l{s.loops}-m{s.micro_batches}" if cfg.trainer.strategy == "bfpp" else "auto"
    n_params = sum(p.numel() for p in model.parameters())
    metrics = PipelineMetrics(
        flops_per_token=flops_per_token(model_cfg, n_params),
        peak_flops=cfg.cluster.peak_flops,
        out_dir=run_dir,
        summary_extra={"model": cfg.model.name, "cluster": cfg.cluster.name, "params": n_params,
                       "global_batch_size": cfg.data.batch_size, "block_size": cfg.model.block_size,
                       "schedule": s.name if cfg.trainer.strategy == "bfpp" else "none",
                       "pipeline_parallel": s.pipeline_parallel if cfg.trainer.strategy == "bfpp" else 1,
                       "loops": s.loops if cfg.trainer.strategy == "bfpp" else 1,
                       "micro_batches": s.micro_batches if cfg.trainer.strategy == "bfpp" else 1},
        log_schedule=bool(cfg.logger.get("log_schedule", True)),
    )
    callbacks = [metrics]
    if cfg.trainer.enable_progress_bar:
        callbacks.append(TQDMProgressBar(refresh_rate=10))
    every = int(cfg.checkpoint.every_n_steps)
    if every > 0:
        # "step-200.ckpt": no '=' in the name, so `ckpt_path=<dir>/step-200.ckpt` needs no quoting for Hydra
        callbacks.append(ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step-{step}", auto_insert_metric_name=False,
                                         every_n_train_steps=every, save_top_k=int(cfg.checkpoint.keep), monitor="step",
                                         mode="max", save_last=True))
    loggers = build_loggers(cfg, run_dir, run_name)
    t = cfg.trainer
    trainer = L.Trainer(
        accelerator=cfg.cluster.accelerator,
        devices=cfg.cluster.devices,
        num_nodes=cfg.cluster.num_nodes,
        strategy=build_strategy(cfg),
        max_steps=t.max_steps,
        val_check_interval=min(t.val_check_interval, t.max_steps),
        check_val_every_n_epoch=None,  # val_check_interval counts batches across epochs
        limit_val_batches=t.limit_val_batches,
        num_sanity_val_steps=0,
        precision=t.precision,
        gradient_clip_val=t.gradient_clip_val,
        accumulate_grad_batches=t.accumulate_grad_batches,
        log_every_n_steps=t.log_every_n_steps,
        logger=loggers or False,
        callbacks=callbacks,
        enable_checkpointing=every > 0,
        enable_progress_bar=t.enable_progress_bar,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
    )
    if trainer.is_global_zero:
        for logger in loggers:
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    started = datetime.now()
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    if trainer.is_global_zero:
        summary = metrics.summary(trainer)
        log.info(f"done in {(datetime.now() - started).total_seconds():.1f}s: train_loss={summary['train_loss']} "
                 f"val_loss={summary['val_loss']} tokens/s={summary['tokens_per_s']} -> {run_dir / 'summary.json'}")
        return summary
    return None


if __name__ == "__main__":
    main()
