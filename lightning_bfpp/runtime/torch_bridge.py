# Scope: the ONLY module touching torch.distributed.pipelining's private schedule runtime
# (_PipelineScheduleRuntime, _Action). We feed it our own lowered action lists. Tested on torch 2.13.
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _torch_schedules

from ..schedule import Op, Schedule

if not (
    hasattr(_torch_schedules, "_PipelineScheduleRuntime")
    and hasattr(getattr(_torch_schedules, "_ComputationType", None), "REDUCE_GRAD")
):
    raise ImportError(
        f"lightning-bfpp needs torch.distributed.pipelining's schedule runtime with UNSHARD/RESHARD/REDUCE_GRAD "
        f"actions (tested on torch 2.13); this is torch {torch.__version__}. Install torch>=2.13."
    )

_TORCH_OP = {
    Op.FORWARD: _torch_schedules._ComputationType.FORWARD,
    Op.BACKWARD: _torch_schedules._ComputationType.FULL_BACKWARD,
    Op.UNSHARD: _torch_schedules._ComputationType.UNSHARD,
    Op.RESHARD: _torch_schedules._ComputationType.RESHARD,
    Op.REDUCE_GRAD: _torch_schedules._ComputationType.REDUCE_GRAD,
    Op.SEND_F: _torch_schedules._ComputationType.SEND_F,
    Op.RECV_F: _torch_schedules._ComputationType.RECV_F,
    Op.SEND_B: _torch_schedules._ComputationType.SEND_B,
    Op.RECV_B: _torch_schedules._ComputationType.RECV_B,
}


def to_torch_actions(schedule: Schedule) -> dict[int, list[Any]]:
    return {
        rank: [_torch_schedules._Action(a.stage, _TORCH_OP[a.op], a.micro_batch) for a in actions]
        for rank, actions in schedule.actions.items()
    }


def build_runtime(
    schedule: Schedule,
    modules: dict[int, nn.Module],
    device: torch.device,
    group,
    loss_fn: Callable | None,
):
    """A torch pipeline runtime over fresh PipelineStages of `modules` that executes `schedule`."""
    spec = schedule.spec
    stages = [
        PipelineStage(mod, stage_index=s, num_stages=spec.num_stages, device=device, group=group)
        for s, mod in sorted(modules.items())
    ]
    runtime = _torch_schedules._PipelineScheduleRuntime(
        stages, n_microbatches=spec.micro_batches, loss_fn=loss_fn, scale_grads=True
    )
    # Our validated, lowered lists replace torch's own lowering (it has no breadth-first x groups order
    # and its FSDP prefetch policy is not ours). The stage->rank map is torch's default "loop" style.
    runtime.pipeline_order_with_comms = to_torch_actions(schedule)
    return runtime, stages
