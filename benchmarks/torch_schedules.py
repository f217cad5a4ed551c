"""Bfpp's four schedules against torch.distributed.pipelining's own public classes over the same stages
(same parameter-balanced cut, same micro-batches, same AdamW): ScheduleLoopedBFS (breadth_first, loops=2),
ScheduleInterleaved1F1B (depth_first, loops=2), ScheduleGPipe, Schedule1F1B. One launch of 2 processes;
each round runs every (schedule, bfpp/torch) pair in rotated order; ratio per round = bfpp ÷ torch throughput."""
from __future__ import annotations

import statistics
from pathlib import Path

from common import launch, rotate, summarize
from p1_overhead import per_step

# bfpp schedule name, loops, torch's class (what worker._torch_schedule builds for the "raw" job)
SCHEDULES = [("breadth_first", 2, "ScheduleLoopedBFS"), ("depth_first", 2, "ScheduleInterleaved1F1B"),
             ("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B")]


def run(out: Path, *, model: str, batch: int, rounds: int, steps: int, warmup: int, pp: int = 2,
        micro_batches: int = 4) -> dict:
    variants = [{"kind": kind, "model": model, "batch": batch, "steps": steps, "pp": pp, "loops": loops,
                 "m": micro_batches, "schedule": name} for name, loops, _ in SCHEDULES for kind in ("bfpp", "raw")]
    jobs = [job for i in range(rounds) for job in rotate(variants, i)]
    results = launch(out, pp, jobs)
    period: dict[tuple[str, str], list[float]] = {}
    for job, res in zip(jobs, results):  # per round, in round order
        period.setdefault((job["schedule"], job["kind"]), []).append(
            statistics.median(per_step(res, "period_s", warmup)))
    rows = {}
    for name, loops, cls in SCHEDULES:
        bf, raw = period[(name, "bfpp")], period[(name, "raw")]
        rows[cls] = {"bfpp_schedule": name, "loops": loops, "ratio": summarize([r / b for b, r in zip(bf, raw)]),
                     "bfpp_period_s": summarize(bf), "torch_period_s": summarize(raw)}
    return {"setting": {"model": model, "batch": batch, "pp": pp, "m": micro_batches, "rounds": rounds, "steps": steps,
                        "warmup": warmup, "processes": pp, "threads_per_process": 1,
                        "timed": "step period (batch start -> next batch start), steps warmup..steps-2"},
            "schedules": rows}
