"""The strategy a run uses: ``trainer.strategy=auto`` (Lightning's) or bfpp, from the ``schedule.*`` group (the
planner's pick under ``schedule.layout=auto``) and the app's checkpoint keys."""
from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.checkpoint import StorageNames


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
        rows = max(1, int(cfg.data.batch_size) // (2 * world_size(cfg)))
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

