"""P4 — throughput of pp=2 (two processes, one thread each) vs one process with one thread,
same model and global batch. Each pair is two separate launches (1 process, then 2, order rotated);
only steady-state step periods are compared, so process start-up does not count."""
from __future__ import annotations

import statistics
from pathlib import Path

from common import launch, rotate, summarize


def run(out: Path, *, model: str, batch: int, rounds: int, steps: int, warmup: int, pp: int = 2, loops: int = 2,
        micro_batches: int = 4, schedule: str = "breadth_first", auto: bool = False) -> dict:
    """`auto`: each round also launches pp=2 with stage_layers="auto" (key "bfpp_auto"; "bfpp" is by parameters)."""
    single = {"kind": "single", "model": model, "batch": batch, "steps": steps, "label": "single"}
    pipe = {"kind": "bfpp", "model": model, "batch": batch, "steps": steps, "pp": pp, "loops": loops,
            "m": micro_batches, "schedule": schedule, "label": "bfpp"}
    variants = [single, pipe] + ([{**pipe, "stage_layers": "auto", "label": "bfpp_auto"}] if auto else [])
    periods: dict[str, list[float]] = {v["label"]: [] for v in variants}
    parts: dict[str, list[float]] = {"compute_s": [], "schedule_s": []}  # bfpp: busy time, schedule span
    for i in range(rounds):
        for job in rotate(variants, i):
            devices = pp if job["kind"] == "bfpp" else 1
            res = launch(out / f"round{i}_{job['label']}", devices, [job])[0]["rank0"]
            periods[job["label"]].append(statistics.median(res["period_s"][warmup : steps - 1]))
            if res["stats"] and job["label"] == "bfpp":  # max over ranks, of the measured (last) step only:
                parts["compute_s"].append(statistics.median(s["compute_s"] for s in res["stats"]))  # periods stay
                parts["schedule_s"].append(statistics.median(s["step_s"] for s in res["stats"]))  # unmeasured
    speedups = [s / p for s, p in zip(periods["single"], periods["bfpp"])]
    return {"setting": {**pipe, "rounds": rounds, "warmup": warmup, "processes": pp, "threads_per_process": 1},
            "speedup": summarize(speedups), "single_period_s": summarize(periods["single"]),
            **({"speedup_auto": summarize([s / p for s, p in zip(periods["single"], periods["bfpp_auto"])]),
                "auto_over_param_throughput": summarize([p / a for p, a in zip(periods["bfpp"], periods["bfpp_auto"])]),
                "bfpp_auto_period_s": summarize(periods["bfpp_auto"])} if auto else {}),
            "bfpp_period_s": summarize(periods["bfpp"]),
            "samples_per_s_single": batch / statistics.median(periods["single"]),
            "samples_per_s_bfpp": batch / statistics.median(periods["bfpp"]),
            # where a pp=2 step goes: ideal = single / 2; compute = busy time of the busiest rank (micro-batch
            # efficiency); schedule - compute = idle in the pipeline; period - schedule = optimizer + Lightning
            "breakdown_s": {"ideal_half_of_single": statistics.median(periods["single"]) / 2,
                            "compute": statistics.median(parts["compute_s"]),
                            "pipeline_idle": (statistics.median(parts["schedule_s"])
                                              - statistics.median(parts["compute_s"])),
                            "outside_schedule": (statistics.median(periods["bfpp"])
                                                 - statistics.median(parts["schedule_s"]))}}
