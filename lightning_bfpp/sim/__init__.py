"""Cost model, step simulator and layout planner over the schedules of `lightning_bfpp.schedule`, and the
calibrated-cluster format (``calibration``).

May import: ``schedule``, ``dims`` (the layout); matplotlib (pictures) and PyYAML (cluster files) besides the standard
library.

Examples:
    >>> from lightning_bfpp.schedule import ScheduleSpec, build_schedule
    >>> from lightning_bfpp.sim import simulate, unit_costs
    >>> sched = build_schedule(ScheduleSpec("gpipe", pipeline_parallel=2, micro_batches=4))
    >>> round(simulate(sched, unit_costs(2, 2)).bubble, 6)  # (pp - 1) / m
    0.25
"""

from .cluster import Cluster, LayerTimes
from .cost import Costs, StageCost, build_costs, kv_gather_bytes, message_bytes, ring_time, unit_costs
from .draw import draw_schedule
from .memory import MemoryReport, memory_report
from .model import Layers, Model, WireBytes, training_flops_per_token
from .simulate import MEGATRON, Event, SimOptions, SimResult, evaluate, simulate

__all__ = [
    "Cluster", "Costs", "LayerTimes", "Layers", "Model", "WireBytes", "StageCost", "build_costs", "kv_gather_bytes",
    "message_bytes",
    "ring_time", "unit_costs", "MemoryReport",
    "memory_report", "draw_schedule", "MEGATRON", "Event", "SimOptions", "SimResult", "evaluate", "simulate",
    "training_flops_per_token",
]
