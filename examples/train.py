"""The Hydra entry point — train the example GPT (or a random-init Hugging Face GPT-2/Llama: model.family)
on the stdlib byte corpus with any schedule.
python examples/train.py                                   # defaults: conf/train.yaml
python examples/train.py model=hf_llama_tiny cluster=cpu_2 # lightning_bfpp.hf.CausalLM (pip install lightning-bfpp[hf])
python examples/train.py model=hf_pretrained model.path=DIR  # fine-tune a save_pretrained model, read per stage
python examples/train.py model=hf_pretrained model.path=DIR model.lora.r=8  # LoRA adapters only (peft)
python examples/train.py model=hf_pretrained model.path=DIR checkpoint.export_hf=OUT  # then a Hugging Face directory
python examples/train.py schedule=1f1b cluster=cpu_2 logger=csv
python examples/train.py -m schedule=breadth_first,depth_first
torchrun --nproc-per-node=4 examples/train.py              # or srun under SLURM
python examples/train.py checkpoint.every_n_steps=100      # then: ckpt_path=<run dir>/checkpoints/step-100.ckpt
python examples/train.py +trainer.max_epochs=1             # any other lightning.Trainer argument"""
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
from hydra.types import RunMode
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from omegaconf import DictConfig, OmegaConf

if __package__:  # `python -m examples.train` (Lightning's launcher relaunches it so): the example's modules are here
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_dir as rundir
from command_line import check_command_line
from config_checks import ConfigError, check_config, text_data
from data import build_datamodule, prepare_text, text_settings
from gpt import GPT, GPTConfig, OptimConfig, flops_per_token

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.adapter.metrics import PipelineMetrics, run_layout
from lightning_bfpp.adapter.trace import PipelineTrace
from lightning_bfpp.checkpoint import StorageNames
from lightning_bfpp.hf import CausalLM
from lightning_bfpp.hf.lora import lora_config

log = logging.getLogger(__name__)
rundir.register_resolvers()  # the run directory's name in conf/train.yaml (examples/run_dir.py)


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


class HFCausalLM(CausalLM):
    """A Hugging Face causal LM with the app's optimizer: the example GPT's parameter groups (no weight decay on
    biases and norms) and warmup + cosine schedule, from `optim.*`."""

    def __init__(self, model, optim: OptimConfig | None = None, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.optim = optim

    configure_optimizers = GPT.configure_optimizers  # uses only self.optim, self.parameters() and self.trainer


def hf_model(m: DictConfig):
    """A random-init GPT2LMHeadModel (model.family=hf_gpt2) or LlamaForCausalLM (hf_llama) from `model.*`, built
    locally: nothing is downloaded."""
    import transformers

    common = dict(vocab_size=m.vocab_size, tie_word_embeddings=m.tie_weights, attn_implementation=m.attn_implementation)
    if m.family == "hf_gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, n_positions=m.block_size, resid_pdrop=m.dropout,
            embd_pdrop=m.dropout, attn_pdrop=m.dropout, bos_token_id=0, eos_token_id=0, **common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=m.n_layer, num_attention_heads=m.n_head, num_key_value_heads=m.n_kv_head,
        hidden_size=m.n_embd, intermediate_size=m.intermediate_size, max_position_embeddings=m.block_size,
        attention_dropout=m.dropout, bos_token_id=0, eos_token_id=0, **common))


def build_model(cfg: DictConfig) -> L.LightningModule:
    """The model of `model.family`: gpt (examples/gpt.py; the default), hf_gpt2 / hf_llama (hf_model, wrapped by
    lightning_bfpp.hf.CausalLM: n_layer + 2 pipeline layers like the GPT) or hf_pretrained (a save_pretrained
    directory, model.path, read per stage). Activation checkpointing under strategy=auto:
    the GPT's blocks, or Hugging Face's own gradient checkpointing; under bfpp the strategy's (build_strategy)."""
    optim = from_config(OptimConfig, cfg.optim)
    optim.betas = tuple(optim.betas)
    if cfg.model.get("family", "gpt") == "gpt":
        return GPT(model_config(cfg), optim)
    lora = lora_settings(cfg)
    if cfg.model.family == "hf_pretrained":  # built on the meta device; each rank reads its own stages' tensors
        lm = HFCausalLM.from_pretrained(cfg.model.path, attn_implementation=cfg.model.attn_implementation, lora=lora)
        lm.optim = optim
    else:
        model = hf_model(cfg.model)
        if lora is not None:  # only the adapters train
            from peft import get_peft_model

            model = get_peft_model(model, lora)
        lm = HFCausalLM(model, optim)
    if cfg.model.activation_checkpointing and cfg.trainer.strategy != "bfpp":
        lm.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return lm


def lora_settings(cfg: DictConfig):
    """The ``peft.LoraConfig`` of `model.lora` (None when model.lora.r is null: every weight trains)."""
    settings = OmegaConf.to_container(cfg.model.lora, resolve=True) if cfg.model.get("lora") is not None else {}
    return lora_config(settings) if settings.get("r") is not None else None


def world_size(cfg: DictConfig) -> int:
    return int(cfg.cluster.devices) * int(cfg.cluster.num_nodes)


def build_strategy(cfg: DictConfig, run_dir: Path | None = None):
    if cfg.trainer.strategy == "auto":
        return "auto"
    if cfg.trainer.strategy != "bfpp":
        raise ValueError(f"trainer.strategy={cfg.trainer.strategy!r}: use bfpp or auto")
    s = OmegaConf.to_container(cfg.schedule, resolve=True)
    # model.activation_checkpointing: applied by the strategy to every layer of every local stage (see model_config)
    ac = bool(cfg.model.get("activation_checkpointing", False))
    s["schedule"] = s.pop("name")
    if s.get("layout") == "auto":
        # schedule.layout=auto: the knobs typed on the command line (schedule=1f1b, schedule.loops=2) are pinned, the
        # others are the planner's; every layout trains data.batch_size samples per step (the data module loads
        # data.batch_size / data_parallel per replica); the layers are timed on block_size-token micro-batches
        import torch

        from lightning_bfpp.layout.auto import KNOBS, AutoLayout

        typed = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
        keys = {o.lstrip("+~").split("=", 1)[0] for o in typed}
        pinned = ({k for k in KNOBS if f"schedule.{k}" in keys}
                  | ({"schedule"} if keys & {"schedule", "schedule.name"} else set()))
        s.update({k: None for k in KNOBS if k not in pinned})
        rows = max(1, int(cfg.data.batch_size) // (2 * int(cfg.cluster.devices) * int(cfg.cluster.num_nodes)))
        s.update(layout=AutoLayout(sample=torch.zeros(rows, int(cfg.model.block_size), dtype=torch.long)),
                 global_batch_size=int(cfg.data.batch_size))
    # a stop signal saves <run dir>/checkpoints/last.ckpt at the next step boundary: ckpt_path=auto resumes it
    signal_checkpoint = run_dir / "checkpoints" / "last.ckpt" if run_dir is not None else None
    strategy = BFPPStrategy(activation_checkpointing=ac, on_signal=cfg.checkpoint.on_signal,
                            async_save=bool(cfg.checkpoint.get("async_save", False)),
                            signal_grace_s=cfg.checkpoint.on_signal_grace_s, signal_checkpoint=signal_checkpoint, **s)
    # a full disk or an unwritable directory names the app's keys (every checkpoint is under the run directory)
    strategy.storage.names = StorageNames(keep="checkpoint.keep", directory="hydra.run.dir")
    return strategy


class WandbRunId(Callback):
    """Keeps the W&B run id in every checkpoint (callback state), so that `ckpt_path=` continues that run."""

    def __init__(self, run_id: str | None) -> None:
        self.run_id = run_id

    def state_dict(self) -> dict:
        return {"id": self.run_id}

    def load_state_dict(self, state_dict: dict) -> None:
        pass  # read before the logger is built (stored_wandb_id); the current run's id stays


def checkpoint_meta(ckpt_path: str | None) -> dict:
    """Lightning's metadata of `ckpt_path` (a bfpp folder or a plain file), read without running code from it
    (BFPP_TRUST_CHECKPOINTS=1 to trust it); {} when there is none or it cannot be read (the strategy's
    pre-launch check names a bad ckpt_path)."""
    if not ckpt_path:
        return {}
    from lightning_bfpp.checkpoint import read_meta

    try:
        return read_meta(ckpt_path)
    except Exception:
        return {}


def stored_wandb_id(ckpt_path: str | None) -> str | None:
    """The W&B run id a checkpoint was written under; None if it has none or cannot be read."""
    return checkpoint_meta(ckpt_path).get("callbacks", {}).get(WandbRunId.__qualname__, {}).get("id")


MODEL_SHAPE = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "tie_weights")


def check_resume_strategy(cfg: DictConfig) -> None:
    """A bfpp checkpoint folder given to trainer.strategy=auto (which reads one file): name the export command."""
    path = Path(str(cfg.ckpt_path)) if cfg.ckpt_path else None
    if cfg.trainer.strategy == "auto" and path is not None and path.is_dir():
        raise ConfigError(
            f"ckpt_path={path} is a folder (a bfpp checkpoint); trainer.strategy=auto resumes one file. Export it with "
            f"its optimizer and loop state: python -m lightning_bfpp.checkpoint {path} "
            f"{path.with_suffix('.plain.ckpt')} --full, then ckpt_path={path.with_suffix('.plain.ckpt')}.")


def check_resume_model(cfg: DictConfig) -> None:
    """`ckpt_path=` of an example GPT trained with other model.* shapes: name them in the app's keys (the strategy
    would name the mismatched parameters, and suggest a LightningModule setting the app has no key for)."""
    saved = checkpoint_meta(cfg.ckpt_path).get("hyper_parameters", {}).get("cfg")
    if not isinstance(saved, dict) or cfg.model.get("family", "gpt") != "gpt":
        return
    differ = [k for k in MODEL_SHAPE if k in saved and saved[k] != cfg.model.get(k)]
    if differ:
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path} was trained with {', '.join(f'model.{k}={saved[k]}' for k in differ)}; "
            f"this run has {', '.join(f'model.{k}={cfg.model.get(k)}' for k in differ)}. Resume with the "
            "checkpoint's settings ("
            + " ".join(f"model.{k}={saved[k]}" for k in differ) + "), or start without ckpt_path.")


def resolve_ckpt_path(cfg: DictConfig, run_dir: Path) -> None:
    """ckpt_path=auto: the newest complete checkpoint in <run dir>/checkpoints (a bfpp folder, or a plain file under
    trainer.strategy=auto), else none; says which. A rerun in the same run directory (hydra.run.dir=..., a SLURM
    requeue, a torchrun restart) so continues where the last one stopped. ckpt_path=null starts fresh."""
    folder = run_dir / "checkpoints"
    if cfg.ckpt_path is None:
        if rundir.global_rank() == "0" and folder.is_dir() and any(folder.iterdir()):
            log.info(f"ckpt_path=null: starting fresh, although {folder} holds checkpoints (ckpt_path=auto resumes "
                     "the newest)")
        return
    if cfg.ckpt_path != "auto":
        return
    from lightning_bfpp.checkpoint import StorageError, newest_to_resume

    # strategy=auto resumes plain files only; bfpp both its folders and plain files; a folder that cannot be read may
    # be the newest: refused rather than passed over
    candidates = []
    if cfg.trainer.strategy == "bfpp":
        try:
            newest_folder, passed = newest_to_resume(folder)
        except StorageError as err:
            raise ConfigError(f"ckpt_path=auto: {err}") from None
        candidates += [newest_folder] if newest_folder is not None else []
        for line in passed if rundir.global_rank() == "0" else []:
            log.info(f"ckpt_path=auto: {line}")
    if folder.is_dir():
        candidates += [p for p in folder.glob("*.ckpt") if p.is_file()]
    newest = max(candidates, key=lambda p: p.stat().st_mtime, default=None)
    cfg.ckpt_path = str(newest) if newest is not None else None
    if rundir.global_rank() == "0":
        log.info(f"ckpt_path=auto: resuming from {newest}" if newest is not None else
                 f"ckpt_path=auto: no checkpoint in {folder}, starting fresh")


def wandb_id() -> str:
    """A new W&B run id (8 characters of [0-9a-f], valid for W&B), known before the run starts."""
    import secrets

    return secrets.token_hex(4)


def build_loggers(cfg: DictConfig, run_dir: Path, run_name: str) -> list:
    name = cfg.logger.name
    if name == "none":
        return []
    if name == "csv":  # one metrics.csv per run directory, continued by a resume into it
        from csv_log import RunDirCSVLogger

        return [RunDirCSVLogger(run_dir, checkpoint_meta(cfg.ckpt_path).get("global_step"))]
    if name == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        online = cfg.logger.mode == "online"
        if not online:
            os.environ["WANDB_MODE"] = "offline"
        hc = HydraConfig.get()
        group = cfg.logger.get("group") or (str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None)
        stored = stored_wandb_id(cfg.ckpt_path) if cfg.logger.get("continue_run", True) else None
        if stored and not cfg.logger.get("id"):
            log.info(f"W&B: continuing run {stored}, which wrote {cfg.ckpt_path}; logger.continue_run=false for a "
                     "new run")
        run_id = cfg.logger.get("id") or stored or wandb_id()
        logger = WandbLogger(
            project=cfg.logger.project, entity=cfg.logger.entity, name=cfg.logger.run_name or run_name,
            tags=list(cfg.logger.tags), save_dir=str(run_dir), offline=not online, group=group,
            id=run_id, resume="allow",
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
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    lock = None
    try:  # the app's keys, before any process starts (the strategy checks its own knobs and the model)
        check_config(cfg)
        lock = rundir.acquire(run_dir) if rundir.global_rank() == "0" else None  # this job's process that owns the dir
        for line in rundir.remove_partial_saves(run_dir) if lock is not None else []:  # no other live run writes there
            log.info(line)
        resolve_ckpt_path(cfg, run_dir)
        check_resume_strategy(cfg)
        check_resume_model(cfg)
        if cfg.data.name == "text":  # the token cache, prepared (or reused) before any process starts
            prepare_text(cfg, checksums=rundir.global_rank() == "0")
    except ConfigError as err:  # a setting to fix, not a crash: the message alone, exit 2
        if lock is not None:
            rundir.release(lock)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    env_before, argv_before = dict(os.environ), list(sys.argv)
    launches_children = "LOCAL_RANK" not in os.environ and not os.environ.get("SLURM_NTASKS")
    if launches_children and world_size(cfg) > 1:
        prepare_relaunch()
    try:
        return train(cfg, run_dir)
    finally:  # a multirun runs the next job in this process: leave no W&B run, process group, launcher env or argv
        import torch.distributed as dist

        if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
            sys.modules["wandb"].finish()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if launches_children:
            os.environ.clear()
            os.environ.update(env_before)
            sys.argv[:] = argv_before  # prepare_relaunch's: the next job's folder reads the sweep from it
        if lock is not None:
            rundir.release(lock)


def trainer_arguments(cfg: DictConfig) -> dict:
    """`trainer.*` as lightning.Trainer arguments (config_checks rejects keys the app sets itself)."""
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    kwargs.pop("strategy")
    if kwargs.get("val_check_interval") is not None and cfg.trainer.max_steps > 0:
        kwargs["val_check_interval"] = min(kwargs["val_check_interval"], cfg.trainer.max_steps)
    return kwargs


class RunConfig(Callback):
    """The loggers' run config (W&B config, CSV hparams.yaml): the composed config, with the schedule knobs the
    strategy runs (schedule.layout=auto picks them at start), plus world_size, data_parallel and params."""

    def __init__(self, config: dict, params: int):
        self.config, self.params = config, params

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not trainer.loggers:
            return
        layout = run_layout(trainer)
        config = {**self.config, "world_size": trainer.world_size, "data_parallel": layout.pop("data_parallel"),
                  "params": self.params}
        if "schedule" in layout:  # under bfpp: what runs, in the schedule group's own keys
            name = layout.pop("schedule")
            config["schedule"] = {**config["schedule"], **layout, "name": name}
        for logger in trainer.loggers:
            logger.log_hyperparams(config)


class LastCheckpoint(Callback):
    """`<run dir>/checkpoints/last.ckpt`: the newest state, written with every `step-N.ckpt` and when training ends
    (when max_steps stops it mid-epoch: at that step's end, which Lightning resumes mid-epoch, so exactly),
    replaced in place (a run resumed into the same directory too). Lightning's own `save_last` skips the end of
    training once it has saved a periodic checkpoint (last.ckpt stayed at the last multiple of every_n_steps)."""

    def __init__(self, path: Path, every_n_steps: int):
        self.path, self.every, self.saved_at = path, every_n_steps, -1

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        # the last step saves here, mid-epoch: saved in on_train_epoch_end, Lightning would resume it at the next epoch
        last = 0 < trainer.max_steps <= trainer.global_step
        if (self.every > 0 and trainer.global_step % self.every == 0) or last:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer)

    def _save(self, trainer: L.Trainer) -> None:
        if trainer.global_step != self.saved_at and not trainer.fast_dev_run and trainer.global_step > 0:
            trainer.save_checkpoint(self.path, weights_only=False)  # named: Lightning logs its default on every rank
            self.saved_at = trainer.global_step


def checkpoint_callbacks(cfg: DictConfig, run_dir: Path) -> list[Callback]:
    """`step-N.ckpt` every checkpoint.every_n_steps steps (the newest checkpoint.keep of them; a run resumed into
    the same directory replaces a step's file) and `last.ckpt` (checkpoint.last)."""
    every, last = int(cfg.checkpoint.every_n_steps), bool(cfg.checkpoint.get("last", True))
    callbacks: list[Callback] = []
    if every > 0:
        # "step-200.ckpt": no '=' in the name, so `ckpt_path=<dir>/step-200.ckpt` needs no quoting for Hydra
        callbacks.append(ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step-{step}",
                                         auto_insert_metric_name=False, every_n_train_steps=every,
                                         save_top_k=int(cfg.checkpoint.keep), monitor="step", mode="max",
                                         enable_version_counter=False))
    if last:
        callbacks.append(LastCheckpoint(run_dir / "checkpoints" / "last.ckpt", every))
    return callbacks


def train(cfg: DictConfig, run_dir: Path) -> dict | None:
    L.seed_everything(cfg.data.seed, workers=True)
    model = build_model(cfg)
    if isinstance(model, CausalLM) and text_data(cfg):  # recorded in checkpoints: checkpoint.export_hf writes it too
        model.tokenizer = text_settings(cfg).tokenizer
    datamodule = build_datamodule(cfg)  # data.name: local_corpus (bytes) or text (a token cache)

    s, bfpp = cfg.schedule, cfg.trainer.strategy == "bfpp"
    auto = bfpp and s.get("layout") == "auto"  # the planner picks the layout at start (printed; in summary.json)
    run_name = ("bfpp-layout-auto" if auto else f"{s.name}-pp{s.pipeline_parallel}-l{s.loops}-m{s.micro_batches}"
                if bfpp else "auto")
    n_params = sum(p.numel() for p in model.parameters())  # a tied weight is one Parameter: counted once
    pp = s.pipeline_parallel if bfpp else 1
    tp = s.get("tensor_parallel", 1) if bfpp else 1
    cp = s.get("context_parallel", 1) if bfpp else 1
    metrics = PipelineMetrics(
        # 6 x matmul weights + 12 L C T (model.n_layer, n_embd, block_size): the HF models' weights count as built
        flops_per_token=flops_per_token(cfg.model, model),
        peak_flops=cfg.cluster.peak_flops,
        out_dir=run_dir,
        summary_extra={"model": cfg.model.name, "cluster": cfg.cluster.name, "params": n_params,
                       # sequences per optimizer step: data.batch_size per batch x the batches accumulated
                       "global_batch_size": cfg.data.batch_size * cfg.trainer.accumulate_grad_batches,
                       "block_size": cfg.model.block_size,
                       "schedule": s.name if bfpp else "none", "pipeline_parallel": pp, "tensor_parallel": tp,
                       "context_parallel": cp,
                       "loops": s.loops if bfpp else 1, "micro_batches": s.micro_batches if bfpp else 1},
        log_schedule=bool(cfg.logger.get("log_schedule", True)),
    )
    callbacks: list[Callback] = [metrics, RunConfig(OmegaConf.to_container(cfg, resolve=True), n_params)]
    if cfg.trainer.enable_progress_bar:
        callbacks.append(TQDMProgressBar(refresh_rate=10))
    checkpoints = checkpoint_callbacks(cfg, run_dir)
    callbacks += checkpoints
    loggers = build_loggers(cfg, run_dir, run_name)
    if loggers:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if cfg.logger.name == "wandb":
        callbacks.append(WandbRunId(loggers[0].version))
    if bfpp and cfg.trace.enabled:  # Chrome/Perfetto traces and pictures of measured steps in <run dir>/traces
        callbacks.append(PipelineTrace(run_dir / "traces", count=cfg.trace.count))
    trainer = L.Trainer(
        **trainer_arguments(cfg),
        accelerator=cfg.cluster.accelerator,
        devices=cfg.cluster.devices,
        num_nodes=cfg.cluster.num_nodes,
        strategy=build_strategy(cfg, run_dir),
        logger=loggers or False,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in checkpoints),
        default_root_dir=str(run_dir),
    )
    started = datetime.now()
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    if cfg.checkpoint.get("export_hf") and trainer.is_global_zero:
        export_hf(run_dir / "checkpoints" / "last.ckpt", Path(cfg.checkpoint.export_hf).expanduser())
    if trainer.is_global_zero:
        summary = metrics.summary(trainer)
        measured, planned = summary["bubble_fraction"], summary["planned_bubble_fraction"]  # planned: schedule.png's
        bubble = f" bubble={measured:.3f} measured ({planned:.3f} planned)" if None not in (measured, planned) else ""
        log.info(f"done in {(datetime.now() - started).total_seconds():.1f}s: train_loss={summary['train_loss']} "
                 f"val_loss={summary['val_loss']} tokens/s={summary['tokens_per_s']}{bubble} -> "
                 f"{run_dir / 'summary.json'}")
        return summary
    return None


def export_hf(checkpoint: Path, out: Path) -> None:
    """`checkpoint` as a Hugging Face directory `out`, by the export command in a process of its own (the training
    processes' group is gone on the other ranks; the whole model is read there, not beside the run's memory)."""
    import subprocess

    cmd = [sys.executable, "-m", "lightning_bfpp.checkpoint", str(checkpoint), "--hf", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"checkpoint.export_hf={out}: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    log.info(f"exported the trained model to {out} (AutoModelForCausalLM.from_pretrained reads it)")


def refuse_a_dir_in_use(argv: list[str]) -> None:
    """Before Hydra writes anything: an explicit `hydra.run.dir` that a live run holds is refused (exit 2).
    The popen launcher's children (and torchrun/SLURM ranks > 0) join their own job's directory."""
    target = rundir.explicit_run_dir(argv)
    if target is None or rundir.global_rank() != "0" or {"-m", "--multirun"} & set(argv):
        return
    try:
        rundir.check_free(target)
    except rundir.RunDirInUse as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    refuse_a_dir_in_use(sys.argv[1:])
    try:  # a misspelt key or config file: "did you mean" before Hydra's own answer
        check_command_line(sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
