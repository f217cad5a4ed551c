"""Per-step cost of bfpp's measurement (step_stats: timing wrappers, saved-tensor hook, world all-gather):
the same bfpp job with measurement on every step and off, in one launch, as interleaved rounds.

Usage: python benchmarks/measure_overhead.py [--model gpt_tiny] [--rounds 5] [--steps 10] [--sharding full]
Prints the median per-step time (on_train_batch_start -> next start) of each variant and the ratio on / off
(per round, then median over rounds).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import fmt, launch, rotate, summarize


def compare(out: Path, variants: dict[str, dict], *, rounds: int, steps: int, warmup: int) -> dict[str, dict]:
    """{label: job} run `rounds` times, rotated; per round the median step period (s) of each label, and
    per round the ratio of each label to the first one."""
    labels = list(variants)
    jobs = [{**variants[label], "label": label} for i in range(rounds) for label in rotate(labels, i)]
    results = launch(out, 2, jobs)
    period: dict[str, list[float]] = {label: [] for label in labels}
    for job, res in zip(jobs, results):
        period[job["label"]].append(statistics.median(res["rank0"]["period_s"][warmup:]))
    base = labels[0]
    return {label: {"period_s": summarize(period[label]),
                    f"ratio_to_{base}": summarize([a / b for a, b in zip(period[label], period[base])])}
            for label in labels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sharding", default="full")
    args = ap.parse_args()
    job = {"kind": "bfpp", "model": args.model, "batch": args.batch, "steps": args.steps, "pp": 2, "loops": 2,
           "m": 4, "schedule": "breadth_first", "sharding": args.sharding}
    variants = {"off": {**job, "measure": 0}, "on": {**job, "measure": 1}}
    with tempfile.TemporaryDirectory() as tmp:
        res = compare(Path(tmp), variants, rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    print(f"{args.model}, pp=2 x loops=2, m=4, batch {args.batch}, {args.rounds} rounds of {args.steps} steps "
          f"(first {args.warmup} not timed)")
    for label, r in res.items():
        print(f"  measure {label:3s}: step period {fmt(r['period_s'], 4)} s   ratio to off {fmt(r['ratio_to_off'])}")


if __name__ == "__main__":
    main()
