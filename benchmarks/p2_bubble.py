"""P2 — measured bubble fraction (idle / compute on each rank's compute timeline, max over ranks, from
BFPPStrategy.step_stats; each rank's own too, and how unequal the ranks' compute is) per schedule vs the formula
(pp-1)/(loops*m) for looped schedules and (pp-1)/m otherwise (a third of it for breadth_first_zb, F:B = 1:2); and P5's
second half: peak saved-activation bytes per schedule; and each schedule's bubble, step period and activation peak /
breadth-first's."""
from __future__ import annotations

import statistics
from pathlib import Path

from common import launch, rotate, summarize

# name, schedule, loops
SCHEDULES = [("breadth_first", "breadth_first", 2), ("depth_first", "depth_first", 2), ("gpipe", "gpipe", 1),
             ("1f1b", "1f1b", 1), ("breadth_first_zb", "breadth_first_zb", 2)]


def theory(pp: int, loops: int, m: int, schedule: str = "breadth_first") -> float:
    """Idle / compute with uniform stages, backward = 2 x forward, free communication; zero bubble leaves only the
    forward fill idle (the weight-gradient passes fill the rest)."""
    return (pp - 1) / (loops * m) / (3 if schedule == "breadth_first_zb" else 1)


def run(out: Path, *, model: str, batch: int, rounds: int, steps: int, warmup: int, pp: int = 2,
        micro_batches: int = 4, stage_layers: tuple = (None,)) -> dict:
    """`stage_layers`: the cuts to compare in the same launch (None: by parameter count, "auto": by time);
    rows of a cut other than None are labelled schedule/cut."""
    labels = [(label if cut is None else f"{label}/{cut}", schedule, loops, cut)
              for cut in stage_layers for label, schedule, loops in SCHEDULES]
    variants = [{"kind": "bfpp", "model": model, "batch": batch, "steps": steps, "pp": pp, "loops": loops,
                 "m": micro_batches, "schedule": schedule, "label": label, "stage_layers": cut,
                 "measure": 1}  # step_stats on every step (measured on demand otherwise: the last step only)
                for label, schedule, loops, cut in labels]
    jobs = [job for i in range(rounds) for job in rotate(variants, i)]
    results = launch(out, pp, jobs)
    bubbles: dict[str, list[float]] = {label: [] for label, *_ in labels}
    compute: dict[str, list[float]] = {label: [] for label, *_ in labels}
    activations: dict[str, list[int]] = {label: [] for label, *_ in labels}
    periods: dict[str, list[float]] = {label: [] for label, *_ in labels}
    rank_bubbles: dict[str, dict[str, list[float]]] = {label: {} for label, *_ in labels}
    imbalance: dict[str, list[float]] = {label: [] for label, *_ in labels}  # busiest rank's compute / idlest's
    for job, res in zip(jobs, results):
        stats = res["rank0"]["stats"][warmup:]  # identical on every rank (max over ranks)
        bubbles[job["label"]].append(statistics.median(s["bubble_fraction"] for s in stats))
        compute[job["label"]].append(statistics.median(s["compute_s"] / s["step_s"] for s in stats))
        activations[job["label"]].append(max(r["memory"]["activation_peak_bytes"] for r in res.values()))
        periods[job["label"]].append(statistics.median(res["rank0"]["period_s"][warmup : steps - 1]))
        for rank in stats[0]["timeline"]:
            rank_bubbles[job["label"]].setdefault(rank, []).append(
                statistics.median(s["timeline"][rank]["bubble_fraction"] for s in stats))
        imbalance[job["label"]].append(statistics.median(
            max(r["compute_s"] for r in s["timeline"].values()) / min(r["compute_s"] for r in s["timeline"].values())
            for s in stats))
    rows = {}
    for label, schedule, loops, cut in labels:
        expected = theory(pp, loops, micro_batches, schedule)
        measured = summarize(bubbles[label])
        rows[label] = {
            "loops": loops, "theory": expected, "measured": measured,
            "abs_error": abs(measured["median"] - expected),
            "busy_fraction_of_step": summarize(compute[label]),
            "bubble_per_rank": {rank: summarize(v) for rank, v in sorted(rank_bubbles[label].items())},
            "compute_max_over_min_rank": summarize(imbalance[label]),
            "activation_peak_bytes": max(activations[label]),
            "activation_vs_breadth_first": None, "stage_layers": cut, "period_s": summarize(periods[label]),
        }
    bf = rows["breadth_first"]
    for row in rows.values():
        row["activation_vs_breadth_first"] = row["activation_peak_bytes"] / bf["activation_peak_bytes"]
        row["bubble_vs_breadth_first"] = row["measured"]["median"] / bf["measured"]["median"]
        row["period_vs_breadth_first"] = row["period_s"]["median"] / bf["period_s"]["median"]
    return {"setting": {"model": model, "batch": batch, "pp": pp, "m": micro_batches, "rounds": rounds,
                        "steps": steps, "warmup": warmup, "processes": pp, "threads_per_process": 1},
            "schedules": rows, "max_abs_error": max(r["abs_error"] for r in rows.values() if r["stage_layers"] is None)}
