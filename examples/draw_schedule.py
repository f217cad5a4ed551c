"""Draw one training step of a pipeline schedule as a Gantt chart (PNG).

    python examples/draw_schedule.py schedule=breadth_first schedule.pipeline_parallel=4 \
        schedule.loops=2 schedule.micro_batches=8 out=bf.png

An illegal combination prints the setting to fix and exits with status 2.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from lightning_bfpp.schedule import ScheduleError, ScheduleSpec
from lightning_bfpp.sim.draw import draw_schedule


def spec_from_cfg(s: DictConfig) -> ScheduleSpec:
    return ScheduleSpec(str(s.name), pipeline_parallel=int(s.pipeline_parallel), loops=int(s.loops),
                        micro_batches=int(s.micro_batches), groups=int(s.groups),
                        reshard_after_forward=bool(s.reshard_after_forward))


@hydra.main(config_path="../conf", config_name="draw", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lightning_bfpp.sim import MEGATRON, Cluster, Model, SimOptions, build_costs

    try:
        spec = spec_from_cfg(cfg.schedule)
        costs = None
        if cfg.costs == "model":
            costs = build_costs(Model.from_dict(cfg.model), Cluster.from_dict(cfg.cluster),
                                pipeline_parallel=spec.pipeline_parallel, loops=spec.loops,
                                data_parallel=int(cfg.data_parallel), micro_batch_size=int(cfg.micro_batch_size),
                                micro_batches=spec.micro_batches, sharding=str(cfg.schedule.sharding))
        elif cfg.costs == "unit":
            from lightning_bfpp.sim import unit_costs

            costs = unit_costs(spec.num_stages, spec.pipeline_parallel, **cfg.unit, sharding=str(cfg.schedule.sharding))
        else:
            raise ValueError(f"costs={cfg.costs!r} must be 'unit' or 'model'.")
        path = draw_schedule(spec, cfg.out, costs=costs, options=MEGATRON if cfg.megatron else SimOptions())
    except (ScheduleError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
