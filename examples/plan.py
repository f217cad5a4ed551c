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
import run_dir  # noqa: E402  (the run directory's name)

run_dir.register_resolvers()


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lightning_bfpp.sim import Cluster, Model, SimOptions
    from lightning_bfpp.sim.planner import format_table, search

    model, cluster = Model.from_dict(cfg.model), Cluster.from_dict(cfg.cluster)
    p = cfg.plan
    options = SimOptions(blocking_reduce=p.runtime_waits == "cpu")
    start = time.perf_counter()
    plans = search(model, cluster, int(cfg.data.batch_size), options=options, top=int(p.top),
                   schedules=list(p.schedules), shardings=list(p.shardings), loops=list(p.loops),
                   max_micro_batches=int(p.max_micro_batches) if p.get("max_micro_batches") else None,
                   max_groups=int(p.max_groups),
                   tensor_parallels=list(p.tensor_parallels) if p.get("tensor_parallels") else None,
                   residencies=("step",))  # the runtime keeps a stage's weights as its schedule lowers them
    elapsed = time.perf_counter() - start
    if not plans:
        print(f"error: no layout of model={cfg.model.name} fits cluster={cfg.cluster.name} "
              f"({cluster.device_memory / 1e9:.1f} GB per device, {cluster.memory_reserve / 1e9:.1f} GB reserved) with data.batch_size={cfg.data.batch_size}; "
              "try a smaller batch, activation checkpointing, or more devices.", file=sys.stderr)
        sys.exit(1)
    print(f"model={cfg.model.name} cluster={cfg.cluster.name} ({cluster.world_size} devices) "
          f"data.batch_size={cfg.data.batch_size}: {len(plans)} layouts fit, searched in {elapsed:.1f} s\n")
    print(format_table(plans, int(p.top)))
    best = plans[0]
    overrides = best.candidate.overrides(cluster=cfg.cluster.name, model=cfg.model.name,
                                         batch_size=int(cfg.data.batch_size))
    c = best.candidate
    print(f"\nbest: {c.schedule} pipeline_parallel={c.pipeline_parallel} data_parallel={c.data_parallel} "
          f"tensor_parallel={c.tensor_parallel} loops={c.loops} micro_batches={c.micro_batches}x{c.micro_batch_size}")
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
