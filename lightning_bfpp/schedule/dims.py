"""The old path of ``lightning_bfpp.dims`` (the parallel layout's one owner, moved to the package's top as torchtitan's
``distributed/parallel_dims.py``): a re-export of the same objects, kept so that existing imports keep working. New
code imports ``lightning_bfpp.dims``."""
from __future__ import annotations

from lightning_bfpp.dims import (
    CP,
    DP,
    DP_CP,
    EDP,
    EP,
    PP,
    SHARDING,
    TP,
    Coordinates,
    ExpertCoordinates,
    LayoutError,
    Names,
    ParallelDims,
    ScheduleError,
    ScheduleSpec,
    default_pipeline_parallel,
    divisors,
    micro_batch_size,
    nearest_multiples,
)

__all__ = [
    "CP", "DP", "DP_CP", "EDP", "EP", "PP", "SHARDING", "TP", "Coordinates", "ExpertCoordinates", "LayoutError",
    "Names", "ParallelDims", "ScheduleError", "ScheduleSpec", "default_pipeline_parallel", "divisors",
    "micro_batch_size", "nearest_multiples",
]
