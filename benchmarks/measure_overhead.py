"""Side-by-side step times of bfpp variants in one launch of 2 processes, as interleaved rounds.

    python benchmarks/measure_overhead.py                  # measurement (step_stats) on every step vs off
    python benchmarks/measure_overhead.py --what grad_sync  # sharding="none": bucketed async all-reduce from each
                                                            # stage's REDUCE_GRAD vs one all-reduce per parameter
                                                            # after the schedule (the earlier code)
    python benchmarks/measure_overhead.py --what cross_step  # FSDP over 2 replicas: cross_step_overlap off vs on
Prints each variant's median step period (on_train_batch_start -> next start) and its ratio to the first
variant (per round, then median over rounds).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import fmt, launch, rotate, summarize


def compare(out: Path, variants: dict[str, dict], *, rounds: int, warmup: int) -> dict[str, dict]:
    """{label: job} run `rounds` times in rotated order; per label the median step period (s) of each round and
    the per-round ratio to the first label."""
    labels = list(variants)
    jobs = [{**variants[label], "label": label} for i in range(rounds) for label in rotate(labels, i)]
    results = launch(out, 2, jobs)
    period: dict[str, list[float]] = {label: [] for label in labels}
    for job, res in zip(jobs, results):
        period[job["label"]].append(statistics.median(res["rank0"]["period_s"][warmup:]))
    base = labels[0]
    return {label: {"period_s": summarize(period[label]),
                    "ratio": summarize([a / b for a, b in zip(period[label], period[base])])} for label in labels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("measure", "grad_sync", "cross_step"), default="measure")
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    job = {"kind": "bfpp", "model": args.model, "batch": args.batch, "steps": args.steps, "m": 4,
           "schedule": "breadth_first"}
    if args.what == "measure":  # pipeline of 2 ranks, FSDP irrelevant (dp = 1)
        job.update(pp=2, loops=2, sharding="full")
        variants = {"off": {**job, "measure": 0}, "on": {**job, "measure": 1}}
    elif args.what == "grad_sync":  # data parallel 2, four local stages: three stages' reductions can overlap later
        job.update(pp=1, loops=4, sharding="none", measure=0)  # backwards
        variants = {"per_parameter": {**job, "grad_sync": "per_parameter"}, "bucketed": job}
    else:  # FSDP over 2 replicas, two local stages: the first stage's gather of the next step starts early
        job.update(pp=1, loops=2, sharding="full", measure=0)
        variants = {"off": job, "on": {**job, "cross_step": True}}
    with tempfile.TemporaryDirectory() as tmp:
        res = compare(Path(tmp), variants, rounds=args.rounds, warmup=args.warmup)
    first = next(iter(variants))
    print(f"{args.what}: {args.model}, pp={job['pp']} x loops={job['loops']}, m=4, sharding={job['sharding']}, "
          f"global batch {args.batch}, {args.rounds} rounds of {args.steps} steps (first {args.warmup} not timed)")
    for label, r in res.items():
        print(f"  {label:14s} step period {fmt(r['period_s'], 4)} s   ratio to {first}: {fmt(r['ratio'])}")


if __name__ == "__main__":
    main()
