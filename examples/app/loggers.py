"""The run's loggers (W&B, offline by default, continuing the run a checkpoint was written under; one CSV per run
directory; or none) and the run config they record."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig

from lightning_bfpp.adapter.metrics import run_layout

from .checkpoints import checkpoint_meta

log = logging.getLogger(__name__)


class WandbRunId(Callback):
    """Keeps the W&B run id in every checkpoint (callback state), so that `ckpt_path=` continues that run."""

    def __init__(self, run_id: str | None) -> None:
        self.run_id = run_id

    def state_dict(self) -> dict:
        return {"id": self.run_id}

    def load_state_dict(self, state_dict: dict) -> None:
        pass  # read before the logger is built (stored_wandb_id); the current run's id stays


def stored_wandb_id(ckpt_path: str | None) -> str | None:
    """The W&B run id a checkpoint was written under; None if it has none or cannot be read."""
    return checkpoint_meta(ckpt_path).get("callbacks", {}).get(WandbRunId.__qualname__, {}).get("id")


def wandb_id() -> str:
    """A new W&B run id (8 characters of [0-9a-f], valid for W&B), known before the run starts."""
    import secrets

    return secrets.token_hex(4)


def build_loggers(cfg: DictConfig, run_dir: Path, run_name: str) -> list:
    name = cfg.logger.name
    if name == "none":
        return []
    if name == "csv":  # one metrics.csv per run directory, continued by a resume into it
        from .csv_log import RunDirCSVLogger

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

