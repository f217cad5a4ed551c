"""`make bench`: run P1 (overhead), P2 (bubble), P4 (scaling), P5 (memory), the FSDP comparison and bfpp against torch's
own schedule classes, write benchmarks/results/summary.json and benchmarks/results/summary.png. See BENCHMARKS.md.

    python benchmarks/run_all.py                 # the full suite (~15 minutes on 2 cores, auto included)
    python benchmarks/run_all.py --quick         # gpt_tiny, 2 rounds: a smoke test, results in the --work dir
    python benchmarks/run_all.py --only p1,p2    # a subset (merged into an existing summary.json)
    python benchmarks/run_all.py --only torch    # bfpp vs ScheduleLoopedBFS/Interleaved1F1B/GPipe/1F1B alone
    python benchmarks/run_all.py --only p2,p4 --compare-auto   # + stage_layers="auto" beside the parameter cut
    python benchmarks/run_all.py --only auto --auto-grid full  # layout="auto" vs all 48 hand-set layouts (~40 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import auto_layout
import p1_overhead
import p2_bubble
import p4_scaling
import p5_memory
import torch_schedules
from common import ROOT
from plot import plot

GOALS = {"p1_overhead_ratio": ("<=", 1.05), "p2_bubble_abs_error": ("<=", 0.05), "p4_speedup": (">=", 1.6),
         "p5_memory_ratio_error": ("<=", 0.05), "auto_layout_ratio": (">=", 0.95)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(GOALS_KEYS),
                    help="comma list of p1 (with the FSDP row), p2, p4, p5, torch (bfpp vs torch's schedule classes), "
                         "auto (layout='auto' vs hand-set layouts)")
    ap.add_argument("--auto-grid", choices=("quick", "full"), default="quick",
                    help="auto: the 12-layout subset (default; ~1.5 min per round) or the issue's 48-layout grid "
                         "(pp 1-2, loops 1/2/4, m 2/4/8, every legal schedule; ~8 min per round)")
    ap.add_argument("--compare-auto", action="store_true",
                    help='P2 and P4 also run stage_layers="auto" (cut by measured time) beside the parameter cut')
    ap.add_argument("--quick", action="store_true", help="gpt_tiny and 2 rounds: checks the machinery only")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved repetitions of each timed comparison")
    ap.add_argument("--model", default="gpt_small", help="conf/model/<name>.yaml")
    ap.add_argument("--batch", type=int, default=16, help="global batch (samples per optimizer step)")
    ap.add_argument("--results", type=Path, default=None,
                    help="where summary.json/.png go (default: benchmarks/results; with --quick: the --work dir)")
    ap.add_argument("--work", type=Path, default=None,
                    help="where launch logs and per-rank files go (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.model, args.rounds = "gpt_tiny", 2
    only = set(args.only.split(","))
    work = args.work or Path(tempfile.mkdtemp(prefix="bfpp-bench-"))
    if args.results is None:  # a smoke run never overwrites the committed results
        args.results = work if args.quick else ROOT / "benchmarks" / "results"
    args.results.mkdir(parents=True, exist_ok=True)
    summary_path = args.results / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() and only != set(GOALS_KEYS) else {}
    size = {"model": args.model, "batch": args.batch}
    timed = {"rounds": args.rounds, "steps": 8, "warmup": 2}  # steps 2..6 are timed; 0-1 warm up, 7 probes memory
    t_all = time.perf_counter()
    print(f"bench: {args.model}, global batch {args.batch}, {args.rounds} rounds; launch files in {work}", flush=True)
    details = summary.setdefault("details", {})
    timings = summary.setdefault("bench_seconds", {})
    errors = summary.setdefault("errors", {})

    def step(key: str, title: str, fn) -> None:
        if key not in only:
            return
        print(title, flush=True)
        t0 = time.perf_counter()
        try:
            fn()
            errors.pop(key, None)
        except Exception as exc:  # keep the other benchmarks' numbers; the error is in summary.json
            errors[key] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
            print(f"  FAILED: {errors[key]}", flush=True)
        timings[key] = round(time.perf_counter() - t0, 1)

    def p1() -> None:
        details["p1_fsdp"] = p1_overhead.run(work / "p1", **size, **timed)
        summary["p1_overhead_ratio"] = details["p1_fsdp"]["p1"]["ratio_period"]["median"]
        fsdp = details["p1_fsdp"]["fsdp"]
        summary["fsdp_comparison"] = {
            "baseline": fsdp["baseline"],
            "throughput_ratio_bfpp_over_fsdp": fsdp["throughput_ratio_bfpp_over_fsdp"]["median"],
            "state_memory_ratio_bfpp_over_fsdp": fsdp["state_memory_ratio_bfpp_over_fsdp"],
            "activation_memory_ratio_bfpp_over_fsdp": fsdp["activation_memory_ratio_bfpp_over_fsdp"],
        }

    def p2() -> None:
        cuts = (None, "auto") if args.compare_auto else (None,)
        details["p2"] = p2_bubble.run(work / "p2", **size, rounds=args.rounds, steps=5, warmup=2, stage_layers=cuts)
        summary["p2_bubble_abs_error"] = details["p2"]["max_abs_error"]

    def p4() -> None:
        details["p4"] = p4_scaling.run(work / "p4", **size, **timed, auto=args.compare_auto)
        summary["p4_speedup"] = details["p4"]["speedup"]["median"]
        if args.compare_auto:
            summary["p4_speedup_auto"] = details["p4"]["speedup_auto"]["median"]

    def p5() -> None:
        details["p5"] = p5_memory.run(work / "p5", **size, steps=2)
        summary["p5_memory_ratio_error"] = details["p5"]["max_error"]

    step("p1", "P1 overhead + FSDP comparison (2 processes)", p1)
    step("p2", "P2 bubble per schedule (2 processes)", p2)
    step("p4", "P4 scaling: 1 process vs pp=2", p4)
    def torch_part() -> None:
        details["torch"] = torch_schedules.run(work / "torch", **size, **timed)
        summary["torch_schedule_ratio"] = {cls: r["ratio"]["median"]
                                           for cls, r in details["torch"]["schedules"].items()}

    def auto_part() -> None:
        full = args.auto_grid == "full"
        details["auto"] = auto_layout.run(work / "auto", **size, rounds=args.rounds, steps=8 if full else 5, warmup=2,
                                          quick=not full)
        summary["auto_layout_ratio"] = details["auto"]["ratio"]["median"]

    step("p5", "P5 memory with FSDP (pp=2 x dp=2, 4 processes)", p5)
    step("torch", "bfpp vs torch.distributed.pipelining's schedule classes, same stages (2 processes)", torch_part)
    step("auto", "layout='auto' vs the best hand-set layout (2 processes)", auto_part)
    values = {k: summary.get(k) for k in GOALS}
    goals = dict(GOALS)
    for cls, ratio in (summary.get("torch_schedule_ratio") or {}).items():  # bfpp ÷ torch's class, each >= 1
        key = f"torch_ratio.{cls.removeprefix('Schedule')}"
        values[key], goals[key] = ratio, (">=", 1.0)
    summary["goals"] = {k: {"goal": f"{op} {v}", "value": values[k],
                            "met": None if values[k] is None else (values[k] <= v if op == "<=" else values[k] >= v)}
                        for k, (op, v) in goals.items()}
    summary["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": __import__("torch").__version__, "lightning": __import__("lightning").__version__,
                          "quick": args.quick, "command": " ".join(["python", *sys.argv])}
    summary["elapsed_s"] = round(time.perf_counter() - t_all, 1)
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, args.results / "summary.png")
    print(json.dumps({k: summary.get(k) for k in (*GOALS, "torch_schedule_ratio", "fsdp_comparison", "bench_seconds",
                                                  "errors", "elapsed_s")},
                     indent=1))
    print(f"wrote {summary_path} and {args.results / 'summary.png'}")
    if errors:
        sys.exit(f"benchmarks failed: {sorted(errors)}")


GOALS_KEYS = ("p1", "p2", "p4", "p5", "torch", "auto")

if __name__ == "__main__":
    main()
