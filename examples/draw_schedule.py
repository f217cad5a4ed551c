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


def _int(key: str, value) -> int:
    """An integer setting as given (int() would turn schedule.micro_batches=2.5 into 2 without a word)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}={value!r} must be an integer.")
    return value


def spec_from_cfg(s: DictConfig) -> ScheduleSpec:
    return ScheduleSpec(str(s.name), pipeline_parallel=_int("schedule.pipeline_parallel", s.pipeline_parallel),
                        loops=_int("schedule.loops", s.loops),
                        micro_batches=_int("schedule.micro_batches", s.micro_batches),
                        groups=_int("schedule.groups", s.groups), reshard_after_forward=bool(s.reshard_after_forward))


@hydra.main(config_path="../conf", config_name="draw", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lightning_bfpp.sim import MEGATRON, Cluster, Model, SimOptions, build_costs

    try:
        spec = spec_from_cfg(cfg.schedule)
        costs = None
        if cfg.costs == "model":
            cluster, tp = Cluster.from_dict(cfg.cluster), _int("schedule.tensor_parallel", cfg.schedule.tensor_parallel)
            dp = _int("data_parallel", cfg.data_parallel)
            if spec.pipeline_parallel * dp * tp > cluster.world_size:
                raise ValueError(f"schedule.pipeline_parallel={spec.pipeline_parallel} x data_parallel={dp} x "
                                 f"schedule.tensor_parallel={tp} processes do not fit cluster={cfg.cluster.name} "
                                 f"({cluster.world_size} devices); use a larger cluster or a smaller data_parallel.")
            costs = build_costs(Model.from_dict(cfg.model), cluster, pipeline_parallel=spec.pipeline_parallel,
                                loops=spec.loops, data_parallel=dp, tensor_parallel=tp,
                                micro_batch_size=_int("micro_batch_size", cfg.micro_batch_size),
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
