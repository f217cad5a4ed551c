"""P1 (overhead of bfpp inside Lightning vs a raw torch.distributed.pipelining loop) and the
comparison row against Lightning's own FSDP (ModelParallelStrategy + fully_shard), measured in one
launch of 2 processes as interleaved rounds: each round runs raw, bfpp and FSDP, in rotated order."""
from __future__ import annotations

import statistics
from pathlib import Path

from common import launch, rotate, summarize


def per_step(result: dict, key: str, warmup: int) -> list[float]:
    """Rank 0's per-step times after `warmup` steps; the last step (memory probes) is not timed."""
    steps = result["rank0"]["job"]["steps"]
    return result["rank0"][key][warmup : steps - 1]


def memory_total(result: dict) -> dict:
    """Max over ranks of parameter + gradient + optimizer bytes, and of saved-activation bytes."""
    ranks = list(result.values())
    state = max(r["memory"]["param_bytes"] + r["memory"]["grad_bytes"] + r["memory"]["optimizer_bytes"] for r in ranks)
    act = max(r["memory"].get("activation_peak_bytes", 0) for r in ranks)
    return {"state_bytes": state, "activation_bytes": act}


def run(out: Path, *, model: str, batch: int, rounds: int, steps: int, warmup: int, pp: int = 2, loops: int = 2,
        micro_batches: int = 4, schedule: str = "breadth_first") -> dict:
    common = {"model": model, "batch": batch, "steps": steps}
    pipe = {**common, "pp": pp, "loops": loops, "m": micro_batches, "schedule": schedule}
    variants = [{"kind": "raw", **pipe}, {"kind": "bfpp", **pipe}, {"kind": "mp", **common}]
    jobs = [job for i in range(rounds) for job in rotate(variants, i)]
    results = launch(out, pp, jobs)
    by_round: list[dict[str, dict]] = [{} for _ in range(rounds)]
    for i, (job, res) in enumerate(zip(jobs, results)):
        by_round[i // len(variants)][job["kind"]] = res

    def ratios(num: str, den: str, key: str) -> list[float]:
        return [statistics.median(per_step(r[num], key, warmup)) / statistics.median(per_step(r[den], key, warmup))
                for r in by_round]

    def seconds(kind: str, key: str) -> list[float]:
        return [statistics.median(per_step(r[kind], key, warmup)) for r in by_round]

    bf_mem, mp_mem = memory_total(by_round[-1]["bfpp"]), memory_total(by_round[-1]["mp"])
    return {
        "setting": {**pipe, "rounds": rounds, "warmup": warmup, "processes": pp, "threads_per_process": 1},
        "p1": {
            "ratio_period": summarize(ratios("bfpp", "raw", "period_s")),
            "ratio_step": summarize(ratios("bfpp", "raw", "step_s")),
            "bfpp_period_s": summarize(seconds("bfpp", "period_s")),
            "raw_period_s": summarize(seconds("raw", "period_s")),
            "bfpp_step_s": summarize(seconds("bfpp", "step_s")),
            "raw_step_s": summarize(seconds("raw", "step_s")),
        },
        "fsdp": {
            "baseline": f"ModelParallelStrategy(data_parallel_size={pp}, tensor_parallel_size=1) + fully_shard per "
                        "layer",
            # throughput ratio at the same global batch = inverse time ratio
            "throughput_ratio_bfpp_over_fsdp": summarize(ratios("mp", "bfpp", "period_s")),
            "fsdp_period_s": summarize(seconds("mp", "period_s")),
            "bfpp_memory": bf_mem,
            "fsdp_memory": mp_mem,
            "state_memory_ratio_bfpp_over_fsdp": bf_mem["state_bytes"] / mp_mem["state_bytes"],
            "activation_memory_ratio_bfpp_over_fsdp": bf_mem["activation_bytes"] / max(mp_mem["activation_bytes"], 1),
        },
    }
