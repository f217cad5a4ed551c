# Scope: P2 — measured bubble fraction (idle / compute on each rank's compute timeline, max over
# ranks, from BFPPStrategy.step_stats) per schedule vs the formula (pp-1)/(loops*m) for looped
# schedules and (pp-1)/m otherwise; and P5's second half: peak saved-activation bytes per schedule.
from __future__ import annotations

import statistics
from pathlib import Path

from common import launch, rotate, summarize

# name, schedule, loops
SCHEDULES = [("breadth_first", "breadth_first", 2), ("depth_first", "depth_first", 2), ("gpipe", "gpipe", 1),
             ("1f1b", "1f1b", 1)]


def theory(pp: int, loops: int, m: int) -> float:
    return (pp - 1) / (loops * m)


def run(out: Path, *, model: str, batch: int, rounds: int, steps: int, warmup: int, pp: int = 2,
        micro_batches: int = 4) -> dict:
    variants = [{"kind": "bfpp", "model": model, "batch": batch, "steps": steps, "pp": pp, "loops": loops,
                 "m": micro_batches, "schedule": schedule, "label": label} for label, schedule, loops in SCHEDULES]
    jobs = [job for i in range(rounds) for job in rotate(variants, i)]
    results = launch(out, pp, jobs)
    bubbles: dict[str, list[float]] = {label: [] for label, _, _ in SCHEDULES}
    compute: dict[str, list[float]] = {label: [] for label, _, _ in SCHEDULES}
    activations: dict[str, list[int]] = {label: [] for label, _, _ in SCHEDULES}
    for job, res in zip(jobs, results):
        stats = res["rank0"]["stats"][warmup:]  # identical on every rank (max over ranks)
        bubbles[job["label"]].append(statistics.median(s["bubble_fraction"] for s in stats))
        compute[job["label"]].append(statistics.median(s["compute_s"] / s["step_s"] for s in stats))
        activations[job["label"]].append(max(r["memory"]["activation_peak_bytes"] for r in res.values()))
    rows = {}
    for label, _, loops in SCHEDULES:
        expected = theory(pp, loops, micro_batches)
        measured = summarize(bubbles[label])
        rows[label] = {
            "loops": loops, "theory": expected, "measured": measured,
            "abs_error": abs(measured["median"] - expected),
            "busy_fraction_of_step": summarize(compute[label]),
            "activation_peak_bytes": max(activations[label]),
            "activation_vs_breadth_first": None,
        }
    for row in rows.values():
        row["activation_vs_breadth_first"] = row["activation_peak_bytes"] / rows["breadth_first"]["activation_peak_bytes"]
    return {"setting": {"model": model, "batch": batch, "pp": pp, "m": micro_batches, "rounds": rounds,
                        "steps": steps, "warmup": warmup, "processes": pp, "threads_per_process": 1},
            "schedules": rows, "max_abs_error": max(r["abs_error"] for r in rows.values())}
