"""Pipeline schedules as data: generate, lower, validate (pure Python).

May import: nothing else of the package, no third-party package (the standard library only). (``dims.py`` here is
the old path of ``lightning_bfpp.dims``, the layout's owner: a re-export of it that nothing in the folder imports.)

Examples:
    >>> from lightning_bfpp.schedule import ScheduleSpec, build_schedule
    >>> sched = build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=2))
    >>> [str(a) for a in sched.compute_actions(0)]
    ['0F0', '0F1', '2F0', '2F1', '2B0', '2B1', '0B0', '0B1']
"""

from __future__ import annotations

from .actions import (
    BREADTH_FIRST,
    COMPUTE_OPS,
    FSDP_OPS,
    LOOPED_SCHEDULES,
    P2P_OPS,
    SCHEDULES,
    Action,
    Op,
    Schedule,
    ScheduleError,
    ScheduleSpec,
)
from .generate import check_spec, compute_order
from .lower import lower
from .validate import validate


def build_schedule(spec: ScheduleSpec) -> Schedule:
    """Generate, lower and validate the schedule described by `spec` (raises ScheduleError)."""
    schedule = Schedule(spec, lower(spec, compute_order(spec)))
    validate(schedule)
    return schedule


__all__ = [
    "Action", "Op", "Schedule", "ScheduleError", "ScheduleSpec", "SCHEDULES", "LOOPED_SCHEDULES", "BREADTH_FIRST",
    "COMPUTE_OPS", "FSDP_OPS", "P2P_OPS", "build_schedule", "check_spec", "compute_order", "lower", "validate",
]
