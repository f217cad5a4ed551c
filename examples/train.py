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

import sys
from datetime import datetime
from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

if __package__:  # `python -m examples.train` (Lightning's launcher relaunches it so): the example's modules are here
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from app import run_dir as rundir
from app.callbacks import report, run_callbacks, run_metrics
from app.checkpoints import export_hf
from app.checks import ConfigError, text_data
from app.command_line import check_command_line
from app.launch import one_job, refuse_a_dir_in_use
from app.loggers import build_loggers
from app.models import build_model
from app.strategy import build_strategy
from data import build_datamodule, text_settings

from lightning_bfpp.hf import CausalLM

rundir.register_resolvers()  # the run directory's name in conf/train.yaml (examples/app/run_dir.py)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> dict | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with one_job(cfg, run_dir):  # checked before any process starts; cleaned up for a multirun's next job
        return train(cfg, run_dir)


def train(cfg: DictConfig, run_dir: Path) -> dict | None:
    """One run: the model, the data, the loggers and callbacks, the Trainer, fit, then the summary."""
    L.seed_everything(cfg.data.seed, workers=True)
    model = build_model(cfg)  # model.family: the example GPT or a Hugging Face causal LM
    if isinstance(model, CausalLM) and text_data(cfg):  # recorded in checkpoints: checkpoint.export_hf writes it too
        model.tokenizer = text_settings(cfg).tokenizer
    datamodule = build_datamodule(cfg)  # data.name: local_corpus (bytes) or text (a token cache)

    loggers = build_loggers(cfg, run_dir, run_name(cfg))
    metrics = run_metrics(cfg, model, run_dir)
    callbacks = run_callbacks(cfg, model, run_dir, metrics, loggers)
    trainer = L.Trainer(
        **trainer_arguments(cfg),
        accelerator=cfg.cluster.accelerator,
        devices=cfg.cluster.devices,
        num_nodes=cfg.cluster.num_nodes,
        strategy=build_strategy(cfg, run_dir),
        logger=loggers or False,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        default_root_dir=str(run_dir),
    )
    started = datetime.now()
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    if cfg.checkpoint.get("export_hf") and trainer.is_global_zero:
        export_hf(run_dir / "checkpoints" / "last.ckpt", Path(cfg.checkpoint.export_hf).expanduser())
    return report(metrics, trainer, started, run_dir) if trainer.is_global_zero else None


def run_name(cfg: DictConfig) -> str:
    """The logger's run name: the layout (``bfpp-layout-auto`` when the planner picks it), or ``auto``."""
    s = cfg.schedule
    if cfg.trainer.strategy != "bfpp":
        return "auto"
    return "bfpp-layout-auto" if s.get("layout") == "auto" else \
        f"{s.name}-pp{s.pipeline_parallel}-l{s.loops}-m{s.micro_batches}"


def trainer_arguments(cfg: DictConfig) -> dict:
    """`trainer.*` as lightning.Trainer arguments (app.checks rejects keys the app sets itself)."""
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    kwargs.pop("strategy")
    if kwargs.get("val_check_interval") is not None and cfg.trainer.max_steps > 0:
        kwargs["val_check_interval"] = min(kwargs["val_check_interval"], cfg.trainer.max_steps)
    return kwargs


if __name__ == "__main__":
    refuse_a_dir_in_use(sys.argv[1:])
    try:  # a misspelt key or config file: "did you mean" before Hydra's own answer
        check_command_line(sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
