"""What a training run reports besides the loss — throughput (tokens/s, model FLOP/s, MFU),
the pipeline bubble and per-rank memory from `strategy.step_stats`, the schedule picture, and a
`summary.json` at the end. Works with any strategy; pipeline numbers appear only under bfpp."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.callbacks import Callback

from ..runtime.instrument import MEMORY_KEYS

log = logging.getLogger(__name__)
# summary.json says which of its numbers this run measured and which are planned
MEASURED = ("tokens_per_s, step_s, model_flops_per_s, mfu and bubble_fraction are measured in this run (means over "
            "the steps after the first warmup_steps; bubble_fraction: idle / busy compute time, max over ranks); "
            "planned_bubble_fraction is the schedule's plan, simulated with unit costs (schedule.png)")


def _per_rank(memory: Any) -> list[dict]:
    """`step_stats["memory"]` as a list of per-rank dicts (accepts {rank: {...}} or [{...}, ...])."""
    if isinstance(memory, dict):
        if memory and all(isinstance(v, dict) for v in memory.values()):
            return list(memory.values())
        return [memory]
    return list(memory or [])


def _scalar(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean())
    return None if value is None else float(value)


def run_layout(trainer: L.Trainer) -> dict[str, Any]:
    """The layout that runs, read from the strategy (under layout='auto' decided at start, so the config's values
    may differ): a BFPPStrategy's schedule knobs, sharding and stage cut; data_parallel = world size otherwise."""
    strategy = trainer.strategy
    spec = getattr(strategy, "spec", None)
    if spec is None:
        return {"data_parallel": trainer.world_size}
    return {"schedule": spec.name, "pipeline_parallel": spec.pipeline_parallel, "data_parallel": strategy.data_parallel,
            "tensor_parallel": strategy.tensor_parallel, "sequence_parallel": strategy.sequence_parallel,
            "expert_parallel": getattr(strategy, "expert_parallel", 1),
            "context_parallel": strategy.context_parallel,
            "loops": spec.loops, "micro_batches": spec.micro_batches,
            "groups": spec.groups, "sharding": strategy.sharding, "reshard_after_forward": spec.reshard_after_forward,
            "stage_layers": strategy.stage_layers}


class PipelineMetrics(Callback):
    """Logs per step: `tokens_per_s`, `step_s`, `model_flops_per_s`, `mfu` (when `peak_flops` is given),
    `bubble_fraction`, `compute_s` and `mem/<kind>_max` (max over ranks) from `strategy.step_stats`.

    The rates and MFU are Lightning's ``Throughput`` over each step (a window of two updates), fed with the job's totals
    (tokens and samples of all data-parallel replicas, the step's FLOPs), so they are the job's, not one device's.
    Without a progress bar, global rank 0 logs ``step N/M: train_loss L, T tokens/s`` every ``log_every_n_steps``
    (this module's logger, at INFO).

    Args:
        flops_per_token: training FLOPs per token of the model (forward + backward); None: no FLOP/s.
        peak_flops: peak FLOP/s of ONE device; MFU = model FLOP/s / (peak_flops * world_size). None: what Lightning
            knows for the device and precision (``get_available_flops``: common NVIDIA GPUs and TPUs; none on CPUs).
        out_dir: where `summary.json` (and `schedule.png`) go; None: not written.
        summary_extra: constant entries added to summary.json (e.g. the config's schedule settings).
        log_schedule: draw the strategy's schedule once and log it (W&B image, file in out_dir).
        warmup_steps: steps left out of the summary's averages (first steps pay for setup).
        validate_at_end: also validate after the last step (`trainer.max_steps`, or the last batch of the last of
            `trainer.max_epochs`), so the summary's
            `val_loss` is the final model's, whatever `val_check_interval` is.
    """

    def __init__(
        self,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        out_dir: str | Path | None = None,
        summary_extra: dict | None = None,
        log_schedule: bool = True,
        warmup_steps: int = 2,
        validate_at_end: bool = True,
    ) -> None:
        self.validate_at_end = validate_at_end
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.summary_extra, self.log_schedule, self.warmup_steps = dict(summary_extra or {}), log_schedule, warmup_steps
        self.history: list[dict[str, float]] = []
        self.last_val_step: int | None = None
        self._t0 = 0.0
        self._throughput: Throughput | None = None  # made at the first step, when the devices are known
        self._totals = {"time": 0.0, "batches": 0, "samples": 0, "lengths": 0}  # the job's, summed over steps
        self.planned_bubble: float | None = None  # the schedule's own (schedule.png), under bfpp
        self._said_step = -1  # the last step said without a progress bar

    # ---- per step ----
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step_s = time.perf_counter() - self._t0
        strategy = trainer.strategy
        dp = getattr(strategy, "data_parallel", None) or trainer.world_size
        inputs, _ = pl_module.pipeline_inputs(batch) if hasattr(pl_module, "pipeline_inputs") else batch
        first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs  # the tokens (e.g. beside document ids)
        tokens = first.numel() * dp  # every data-parallel replica processes a different slice of the batch
        row = {"step_s": step_s, **self._rates(trainer, step_s, tokens, first.shape[0] * dp)}
        # only a measured step's numbers (bfpp measures on logging steps by default: measure_every_n_steps)
        stats = getattr(strategy, "step_stats", None) if getattr(strategy, "measured_step", True) else None
        if stats:
            for key in ("bubble_fraction", "compute_s"):
                if stats.get(key) is not None:
                    row[key] = float(stats[key])
            if stats.get("step_s") is not None:
                row["pipeline_step_s"] = float(stats["step_s"])
            ranks = _per_rank(stats.get("memory"))
            for key in MEMORY_KEYS:
                values = [r[key] for r in ranks if r.get(key) is not None]
                if values:
                    row[f"mem/{key}_max"] = float(max(values))
        for key, value in row.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, prog_bar=key in ("tokens_per_s", "bubble_fraction"))
        loss = _scalar(trainer.callback_metrics.get("train_loss"))
        self.history.append({"step": trainer.global_step, **row, **({"train_loss": loss} if loss is not None else {})})
        self._say_progress(trainer, loss, row["tokens_per_s"])
        last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
        if self.validate_at_end and (0 < trainer.max_steps <= trainer.global_step
                                     or (last_epoch and trainer.is_last_batch)):
            trainer.should_stop = True  # the epoch loop validates when asked to stop (see _should_check_val_fx)

    def _say_progress(self, trainer: L.Trainer, loss: float | None, tokens_per_s: float) -> None:
        """Without a progress bar: one line every `log_every_n_steps` optimizer steps on global rank 0."""
        step, every = trainer.global_step, trainer.log_every_n_steps
        if (trainer.progress_bar_callback is not None or not trainer.is_global_zero or not every or step % every
                or step == self._said_step):
            return
        self._said_step = step  # accumulating batches share the step
        of = f"/{trainer.max_steps}" if trainer.max_steps > 0 else ""
        log.info(f"step {step}{of}: train_loss {'n/a' if loss is None else f'{loss:.4f}'}, "
                 f"{tokens_per_s:,.0f} tokens/s")

    def _rates(self, trainer: L.Trainer, step_s: float, tokens: int, samples: int) -> dict[str, float]:
        """tokens_per_s, model_flops_per_s and mfu of this step (Lightning's Throughput over the job's totals)."""
        if self._throughput is None:
            self._throughput = self._new_throughput(trainer)
        totals = self._totals
        totals.update(time=totals["time"] + step_s, batches=totals["batches"] + 1,
                      samples=totals["samples"] + samples, lengths=totals["lengths"] + tokens)
        flops = tokens * self.flops_per_token if self.flops_per_token else None
        self._throughput.update(**totals, flops=flops)
        rates = self._throughput.compute()
        row = {"tokens_per_s": rates["device/items_per_sec"]}
        if "device/flops_per_sec" in rates:
            row["model_flops_per_s"] = rates["device/flops_per_sec"]
        if "device/mfu" in rates:
            row["mfu"] = rates["device/mfu"]
        return row

    def _new_throughput(self, trainer: L.Trainer) -> Throughput:
        """One 'device' standing for the whole job: its peak is the sum over the world's devices."""
        peak = self.peak_flops
        if peak is None and self.flops_per_token:
            dtype = torch.bfloat16 if str(trainer.precision).startswith("bf16") else torch.float32
            peak = get_available_flops(trainer.strategy.root_device, dtype)
        throughput = Throughput(available_flops=peak * trainer.world_size if peak else None, window_size=2)
        throughput.update(**self._totals, flops=0 if self.flops_per_token else None)  # the window's start
        return throughput

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.last_val_step = trainer.global_step

    # ---- once ----
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        schedule = getattr(trainer.strategy, "schedule", None)
        if schedule is None or not trainer.is_global_zero:
            return
        from ..sim.draw import draw_schedule, planned_step

        spec = getattr(schedule, "spec", schedule)  # a Schedule, or already its ScheduleSpec
        planned = planned_step(spec)  # the schedule simulated with unit costs: the plan the picture shows
        self.planned_bubble = planned.bubble
        if not self.log_schedule or self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            path = Path(draw_schedule(planned, self.out_dir / "schedule.png") or self.out_dir / "schedule.png")
        except Exception as err:  # a picture must never stop training
            log.warning(f"could not draw the schedule: {err!r}")
            return
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):  # WandbLogger
                logger.log_image(key="schedule", images=[str(path)], caption=[str(getattr(spec, "name", ""))])

    def summary(self, trainer: L.Trainer) -> dict[str, Any]:
        """Final numbers: last losses, and averages over the steps after the first `warmup_steps`."""
        rows = self.history[self.warmup_steps :] or self.history
        strategy = trainer.strategy

        def mean(key: str) -> float | None:
            values = [r[key] for r in rows if key in r]
            return sum(values) / len(values) if values else None

        out: dict[str, Any] = dict(self.summary_extra)
        out.update(
            train_loss=_scalar(trainer.callback_metrics.get("train_loss")),
            val_loss=_scalar(trainer.callback_metrics.get("val_loss")),
            val_step=self.last_val_step,
            steps=trainer.global_step,
            world_size=trainer.world_size,
            tokens_per_s=mean("tokens_per_s"),
            step_s=mean("step_s"),
            model_flops_per_s=mean("model_flops_per_s"),
            mfu=mean("mfu"),
            bubble_fraction=mean("bubble_fraction"),
            planned_bubble_fraction=self.planned_bubble,
            measured=MEASURED,
            strategy=type(strategy).__name__,
        )
        out.update(run_layout(trainer))
        stats = getattr(strategy, "step_stats", None)
        if stats and stats.get("memory") is not None:
            out["memory"] = stats["memory"]
        if stats and stats.get("p2p_message_bytes"):  # the largest activation message a pipeline rank sends
            out["p2p_message_bytes"] = int(stats["p2p_message_bytes"])
        return out

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.out_dir is None or not trainer.is_global_zero:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        summary = self.summary(trainer)
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        log.info(f"summary: {json.dumps(summary, default=str)}")
