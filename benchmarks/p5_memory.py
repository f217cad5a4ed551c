"""P5 — per-rank parameter + gradient + optimizer-state bytes under bfpp with FSDP
(sharding=full, pp x dp processes) vs full model / (pp*dp). The gap is split into what the
pipeline partition causes (stages are whole layers) and what FSDP's padding of uneven shards adds."""
from __future__ import annotations

from pathlib import Path

from common import launch, model_config


def model_layers(model: str) -> list[int]:
    """Parameter count of each pipeline layer of the example GPT (built on CPU, here, once)."""
    from gpt import GPT, GPTConfig

    gpt = GPT(GPTConfig(**model_config(model)))
    return [sum(p.numel() for p in layer.parameters()) for layer in gpt.pipeline_layers()]


def run(out: Path, *, model: str, batch: int, steps: int, pp: int = 2, dp: int = 2, loops: int = 2,
        micro_batches: int = 4, schedule: str = "breadth_first") -> dict:
    from lightning_bfpp.schedule.stage_cut import balanced_stage_layers

    job = {"kind": "bfpp", "model": model, "batch": batch, "steps": steps, "pp": pp, "loops": loops,
           "m": micro_batches, "schedule": schedule, "sharding": "full"}
    res = launch(out, pp * dp, [job])[0]
    layers = model_layers(model)
    total = sum(layers)
    layout = balanced_stage_layers(layers, pp * loops)
    stage_params, start = [], 0
    for n in layout:
        stage_params.append(sum(layers[start : start + n]))
        start += n
    rank_params = [sum(stage_params[s] for s in range(r, pp * loops, pp)) for r in range(pp)]
    bytes_per = 4  # float32 parameters and gradients; AdamW keeps two float32 moments
    expected = {"param_bytes": total * bytes_per / (pp * dp), "grad_bytes": total * bytes_per / (pp * dp),
                "optimizer_bytes": 2 * total * bytes_per / (pp * dp)}
    expected["state_bytes"] = sum(expected.values())
    ranks = {}
    for name, r in sorted(res.items()):
        mem = dict(r["memory"])
        mem["state_bytes"] = mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"]
        ranks[name] = mem
    worst = max(ranks.values(), key=lambda m: m["state_bytes"])
    errors = {k: max(abs(m[k] / expected[k] - 1) for m in ranks.values()) for k in expected}
    partition_error = max(rank_params) / (total / pp) - 1  # before any sharding
    return {
        "setting": {**job, "data_parallel": dp, "processes": pp * dp},
        "model_params": total, "stage_layers": layout, "stage_params": stage_params,
        "expected_per_rank": expected, "per_rank": ranks, "max_rank": worst,
        "error": errors, "max_error": max(errors.values()),
        "partition_error": partition_error,
        "fsdp_padding_error": (1 + errors["state_bytes"]) / (1 + partition_error) - 1,
    }
