"""lightning-bfpp: Breadth-First Pipeline Parallelism (arXiv 2211.05953) as a Lightning strategy.

``import lightning_bfpp`` registers ``Trainer(strategy="bfpp")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .hooks import PipelineHooks
from .schedule import ScheduleError, ScheduleSpec, build_schedule
from .strategy import BFPPStrategy

if "bfpp" not in StrategyRegistry:
    StrategyRegistry.register(
        "bfpp", BFPPStrategy, description="Breadth-first pipeline parallelism with FSDP over data parallel"
    )

__all__ = ["BFPPStrategy", "PipelineHooks", "ScheduleError", "ScheduleSpec", "build_schedule"]
