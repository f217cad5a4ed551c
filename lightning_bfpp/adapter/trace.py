"""``PipelineTrace``: what a measured training step did on every rank, as files a user opens — a Chrome/Perfetto trace
(``runtime.chrome_trace``: compute passes, sends, receives, gathers, reductions) and a Gantt picture of the measured
step under the planned one (the schedule simulated at the stage times the step measured) — saved in a folder and logged
to W&B."""
from __future__ import annotations

import json
import logging
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ..runtime.chrome_trace import chrome_trace, rank_record
from ..schedule import Schedule
from ..sim import Costs, Event, SimResult, StageCost, evaluate
from ..sim.draw import draw_measured

log = logging.getLogger(__name__)
_COMM = {"UNSHARD": "UNSHARD", "REDUCE_GRAD": "REDUCE", "SEND_F": "SEND_F", "SEND_B": "SEND_B"}  # drawn under compute


class PipelineTrace(Callback):
    """Writes ``step<N>.json`` (Chrome trace event format: open it at https://ui.perfetto.dev or chrome://tracing) and
    ``step<N>.png`` (measured beside planned) into `dirpath` for the first `count` measured training steps after
    step `skip` (bfpp measures on Lightning's logging steps by default: ``measure_every_n_steps``), and logs them to
    W&B when a WandbLogger is among the trainer's loggers. Every rank's timeline is gathered to global rank 0 on those
    steps only (a collective: every rank runs this callback). Does nothing under another strategy.

    Args:
        dirpath: the folder (created on rank 0).
        count: how many measured steps to trace.
        skip: traced steps start after this global step (the first steps pay for setup: shape inference, compiles).
    """

    def __init__(self, dirpath: str | Path, count: int = 3, skip: int = 1) -> None:
        self.dirpath, self.count, self.skip = Path(dirpath), count, skip
        self.written: list[Path] = []  # the traces written so far (rank 0)
        self._traced = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        strategy = trainer.strategy
        runner = getattr(strategy, "runner", None)
        if (runner is None or not getattr(strategy, "measured_step", False) or self._traced >= self.count
                or trainer.global_step <= self.skip):
            return
        self._traced += 1
        record = rank_record(runner.timeline)
        records: list[dict | None] = [None] * trainer.world_size
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            dist.all_gather_object(records, record)
        else:
            records = [record]
        if trainer.is_global_zero:
            self._write(trainer, dict(enumerate(records)), strategy.schedule, strategy.dims)

    def _write(self, trainer: L.Trainer, records: dict[int, dict], schedule: Schedule, dims) -> None:
        step = trainer.global_step
        spec = schedule.spec
        title = (f"{spec.name}, pp={spec.pipeline_parallel} x dp={dims.data_parallel}"
                 + (f" x tp={dims.tensor_parallel}" if dims.tensor_parallel > 1 else "")
                 + f", loops={spec.loops}, micro_batches={spec.micro_batches}")
        self.dirpath.mkdir(parents=True, exist_ok=True)
        trace_path = self.dirpath / f"step{step}.json"
        trace_path.write_text(json.dumps(chrome_trace(records, dims, step=step, title=title)))
        self.written.append(trace_path)
        picture = self.dirpath / f"step{step}.png"
        try:
            draw_measured(measured_events(records, dims), planned_at_measured_speed(schedule, records), picture,
                          title=f"step {step}, {title}")
        except Exception as err:  # a picture must never stop training
            log.warning(f"could not draw the measured step: {err!r}")
            picture = None
        for logger in trainer.loggers:
            if hasattr(logger, "log_image") and picture is not None:  # WandbLogger
                logger.log_image(key="pipeline_trace", images=[str(picture)], caption=[f"step {step}"], step=step)
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "save") and type(logger).__name__ == "WandbLogger":
                experiment.save(str(trace_path), base_path=str(self.dirpath.parent), policy="now")


def measured_events(records: dict[int, dict], dims) -> list[Event]:
    """The simulator's `Event`s of the measured step, one lane per pipeline rank (the first replica's first tp rank,
    as the plan draws one replica): compute passes, and the gathers, reductions and sends under them."""
    lanes = {rank: dims.coordinates(rank).pipeline for rank in records  # one rank per pipeline rank
             if dims.coordinates(rank)[1:] == (0, 0, 0)}  # replica, tensor- and context-parallel rank 0
    events = []
    for rank, pipeline in lanes.items():
        record = records[rank]
        events += [Event(pipeline, kind, stage, mb, a, b) for kind, stage, mb, a, b in record["compute"]]
        events += [Event(pipeline, _COMM[kind], stage, mb, a, b) for kind, stage, mb, a, b in record["actions"]
                   if kind in _COMM]
    return events


def planned_at_measured_speed(schedule: Schedule, records: dict[int, dict]) -> SimResult:
    """`schedule` simulated with each stage's median measured forward and backward (input and weight parts kept
    apart) and free communication: the plan on the measured step's time scale."""
    times: dict[tuple[int, str], list[float]] = defaultdict(list)
    for record in records.values():
        for kind, stage, _, a, b in record["compute"]:
            times[(stage, kind)].append(b - a)

    def median(stage: int, kind: str) -> float:
        return statistics.median(times[(stage, kind)]) if times[(stage, kind)] else 0.0

    stages = []
    for s in range(schedule.spec.num_stages):
        weight, backward = median(s, "W"), median(s, "B") or median(s, "I") + median(s, "W")
        stages.append(StageCost(median(s, "F"), backward, params=1, activation=1.0,
                                weight_fraction=weight / backward if backward and weight else 0.5))
    return evaluate(schedule, Costs(stages, sharding="none"))
