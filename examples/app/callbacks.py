"""The callbacks of a run: bfpp's metrics (tokens/s, MFU, bubble, ``summary.json``), the run config for the loggers,
the progress bar, checkpoints, the learning rate, the W&B run id and, with ``trace.enabled``, pipeline traces."""
from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path

import lightning as L
from gpt import flops_per_token
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, TQDMProgressBar
from omegaconf import DictConfig, OmegaConf

from lightning_bfpp.adapter.metrics import PipelineMetrics
from lightning_bfpp.adapter.trace import PipelineTrace

from .checkpoints import checkpoint_callbacks
from .loggers import RunConfig, WandbRunId

log = logging.getLogger(__name__)


def run_metrics(cfg: DictConfig, model: L.LightningModule, run_dir: Path) -> PipelineMetrics:
    """bfpp's metrics callback, with the run's model, cluster and layout in ``summary.json``."""
    s, bfpp = cfg.schedule, cfg.trainer.strategy == "bfpp"
    knob = lambda key, default=1: s.get(key, default) if bfpp else 1  # noqa: E731
    return PipelineMetrics(
        # 6 x matmul weights + 12 L C T (model.n_layer, n_embd, block_size): the HF models' weights count as built
        flops_per_token=flops_per_token(cfg.model, model),
        peak_flops=cfg.cluster.peak_flops,
        out_dir=run_dir,
        summary_extra={"model": cfg.model.name, "cluster": cfg.cluster.name, "params": parameters(model),
                       # sequences per optimizer step: data.batch_size per batch x the batches accumulated
                       "global_batch_size": cfg.data.batch_size * cfg.trainer.accumulate_grad_batches,
                       "block_size": cfg.model.block_size,
                       "schedule": s.name if bfpp else "none", "pipeline_parallel": knob("pipeline_parallel"),
                       "tensor_parallel": knob("tensor_parallel"), "context_parallel": knob("context_parallel"),
                       "loops": knob("loops"), "micro_batches": knob("micro_batches")},
        log_schedule=bool(cfg.logger.get("log_schedule", True)),
    )


def parameters(model: L.LightningModule) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight is one Parameter: counted once


def run_callbacks(cfg: DictConfig, model: L.LightningModule, run_dir: Path, metrics: PipelineMetrics,
                  loggers: list) -> list[Callback]:
    callbacks: list[Callback] = [metrics, RunConfig(OmegaConf.to_container(cfg, resolve=True), parameters(model))]
    if cfg.trainer.enable_progress_bar:
        callbacks.append(TQDMProgressBar(refresh_rate=10))
    callbacks += checkpoint_callbacks(cfg, run_dir)
    if loggers:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if cfg.logger.name == "wandb":
        callbacks.append(WandbRunId(loggers[0].version))
    if cfg.trainer.strategy == "bfpp" and cfg.trace.enabled:  # Chrome/Perfetto traces and pictures in <run dir>/traces
        callbacks.append(PipelineTrace(run_dir / "traces", count=cfg.trace.count))
    return callbacks


def report(metrics: PipelineMetrics, trainer: L.Trainer, started: datetime, run_dir: Path) -> dict:
    """The run's summary (``summary.json``), and one line of it in the log."""
    summary = metrics.summary(trainer)
    measured, planned = summary["bubble_fraction"], summary["planned_bubble_fraction"]  # planned: schedule.png's
    bubble = f" bubble={measured:.3f} measured ({planned:.3f} planned)" if None not in (measured, planned) else ""
    log.info(f"done in {(datetime.now() - started).total_seconds():.1f}s: train_loss={summary['train_loss']} "
             f"val_loss={summary['val_loss']} tokens/s={summary['tokens_per_s']}{bubble} -> "
             f"{run_dir / 'summary.json'}")
    return summary
