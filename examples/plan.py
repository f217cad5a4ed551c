"""Pick a pipeline/data/tensor-parallel layout for a model, a cluster and a global batch size by simulation.

    python examples/plan.py model=gpt_52b cluster=slurm_gpu_64 data.batch_size=256

Prints the ranked layouts that fit in device memory, the Hydra overrides of the best one for
examples/train.py, and writes plan.json into its run directory, outputs/plan/<date>/<time>-<tag>/
(`hydra.run.dir=<dir>` to choose it; `plan.out=null` writes nothing).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from app import run_dir

from lightning_bfpp.schedule.checks import is_count

run_dir.register_resolvers()


def _ints(least: int):
    return lambda v: is_count(v, least)


def check_plan(cfg: DictConfig) -> None:
    """Exit 2 naming the key when a setting would otherwise be truncated, ignored or reported as 'does not fit'."""
    from lightning_bfpp.schedule.actions import SCHEDULES
    from lightning_bfpp.sim.cost import SHARDINGS

    def each(test):
        return lambda v: v is not None and len(v) > 0 and all(test(x) for x in v)

    rules = [  # (key, holds, what it must be)
        ("data.batch_size", _ints(1), "an integer >= 1 (the global batch)"),
        ("model.n_layer", _ints(1), "an integer >= 1"), ("model.n_head", _ints(1), "an integer >= 1"),
        ("plan.top", _ints(1), "an integer >= 1 (rows printed)"),
        ("plan.schedules", each(lambda x: x in SCHEDULES), f"a list of {', '.join(SCHEDULES)}"),
        ("plan.shardings", each(lambda x: x in SHARDINGS), f"a list of {', '.join(SHARDINGS)}"),
        ("plan.loops", each(_ints(1)), "a list of integers >= 1"),
        ("plan.max_micro_batches", lambda v: v is None or _ints(1)(v), "an integer >= 1 or null"),
        ("plan.max_groups", _ints(1), "an integer >= 1"),
        ("plan.tensor_parallels", lambda v: v is None or each(_ints(1))(v), "a list of integers >= 1 or null"),
        ("plan.sequence_parallels", each(lambda x: isinstance(x, bool)), "a list of true / false"),
        ("plan.runtime_waits", lambda v: v in ("fsdp", "cpu"), "fsdp or cpu"),
        ("plan.expert_parallels", lambda v: v is None or each(_ints(1))(v), "a list of integers >= 1 or null"),
        ("plan.expert_overlap", lambda v: isinstance(v, bool), "true or false"),
        ("plan.context_parallels", each(_ints(1)), "a list of integers >= 1"),
        ("plan.shard_units", each(lambda x: x in ("stage", "layer")), "a list of stage / layer"),
    ]
    for key, holds, rule in rules:
        value = OmegaConf.select(cfg, key)
        value = list(value) if OmegaConf.is_list(value) else value
        if not holds(value):
            sys.exit(f"error: {key}={value!r} must be {rule}.")
    if cfg.model.n_embd % cfg.model.n_head:
        sys.exit(f"error: model.n_embd={cfg.model.n_embd} must be divisible by model.n_head={cfg.model.n_head}.")
    if cfg.model.get("family", "gpt") != "gpt":
        print(f"note: model.family={cfg.model.family} is simulated as a GPT of the same n_layer x n_embd x vocab "
              "(its own MLP width, key/value heads and tying are not modelled).", file=sys.stderr)


def _expert_sizes(n_experts: int) -> list[int]:
    """plan.expert_parallels=null: every divisor of the model's experts up to 64 (1 alone without experts)."""
    return [e for e in range(1, min(n_experts, 64) + 1) if n_experts % e == 0] if n_experts else [1]


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lightning_bfpp.sim import Cluster, Model, SimOptions
    from lightning_bfpp.sim.planner import format_table, search

    check_plan(cfg)
    model, cluster = Model.from_dict(cfg.model), Cluster.from_dict(cfg.cluster)
    p = cfg.plan
    options = SimOptions(blocking_reduce=p.runtime_waits == "cpu", expert_overlap=p.expert_overlap)
    experts = list(p.expert_parallels) if p.expert_parallels else _expert_sizes(model.n_experts)
    start = time.perf_counter()
    plans = search(model, cluster, int(cfg.data.batch_size), options=options, top=int(p.top),
                   schedules=list(p.schedules), shardings=list(p.shardings), loops=list(p.loops),
                   max_micro_batches=int(p.max_micro_batches) if p.get("max_micro_batches") else None,
                   max_groups=int(p.max_groups),
                   tensor_parallels=list(p.tensor_parallels) if p.get("tensor_parallels") else None,
                   sequence_parallels=[bool(v) for v in p.sequence_parallels],
                   residencies=("step",),  # the runtime keeps a stage's weights as its schedule lowers them
                   expert_parallels=experts, context_parallels=list(p.context_parallels),
                   shard_units=list(p.shard_units))
    elapsed = time.perf_counter() - start
    if not plans:
        print(f"error: no layout of model={cfg.model.name} on cluster={cfg.cluster.name} with data.batch_size="
              f"{cfg.data.batch_size} is both legal and fits: either plan.schedules / plan.loops / "
              "plan.tensor_parallels / plan.context_parallels allow no legal layout (tensor_parallel divides "
              "cluster.devices and model.n_head; tensor_parallel x context_parallel divides the devices and the "
              "sequence splits over context_parallel; "
              "pipeline_parallel x loops <= model.n_layer + 2; the batch splits over data_parallel x micro_batches), "
              f"or none fits {cluster.device_memory / 1e9:.1f} GB per device ({cluster.memory_reserve / 1e9:.1f} GB "
              "reserved): then try a smaller batch, activation checkpointing, or more devices.", file=sys.stderr)
        sys.exit(1)
    print(f"model={cfg.model.name} cluster={cfg.cluster.name} ({cluster.world_size} devices) "
          f"data.batch_size={cfg.data.batch_size}: {len(plans)} fitting layouts simulated in full (the others could "
          f"not reach the top {p.top}: skipped by a step-time bound), searched in {elapsed:.1f} s\n")
    print(format_table(plans, int(p.top)))
    best = plans[0]
    overrides = best.candidate.overrides(cluster=cfg.cluster.name, model=cfg.model.name,
                                         batch_size=int(cfg.data.batch_size))
    c = best.candidate
    print(f"\nbest: {c.schedule} pipeline_parallel={c.pipeline_parallel} data_parallel={c.data_parallel} "
          f"tensor_parallel={c.tensor_parallel} sequence_parallel={c.sequence_parallel} "
          f"expert_parallel={c.expert_parallel} loops={c.loops} "
          f"micro_batches={c.micro_batches}x{c.micro_batch_size}")
    print("\nbest layout for examples/train.py:\n  " + " ".join(overrides))
    if p.out:
        out = Path(HydraConfig.get().runtime.output_dir) / p.out  # an absolute plan.out stays as it is
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            json.dump({"model": cfg.model.name, "cluster": cfg.cluster.name, "batch_size": int(cfg.data.batch_size),
                       "config": OmegaConf.to_container(cfg.plan), "best_overrides": overrides,
                       "plans": [pl.as_dict() for pl in plans]}, f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
