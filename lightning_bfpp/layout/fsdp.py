"""FSDP2 over data parallel for one pipeline stage: one all-gather per stage per pass, and the mixed-precision
policy a Lightning precision gives it."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def shard_stage(module: nn.Module, dp_mesh: DeviceMesh, mp_policy=None) -> nn.Module:
    """FSDP2-shard one stage as a single unit: one all-gather per stage per pass.

    Weights stay gathered after forward (``reshard_after_forward=False``): when to free and gather
    them again is decided by the schedule's RESHARD/UNSHARD actions, not by FSDP's own hooks.
    `mp_policy`: FSDP2 MixedPrecisionPolicy (see `stage_mixed_precision`), None: the module's own dtype.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    return fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy or MixedPrecisionPolicy())


def stage_mixed_precision(precision: str, last_stage: bool):
    """FSDP2 MixedPrecisionPolicy of a sharded stage under Lightning's `precision` (None: no policy).

    "bf16-mixed": the sharded parameters stay fp32 (the optimizer's master weights); FSDP casts them to
    bf16 when it gathers them (all-gathers move bf16), the stage's float inputs are cast to bf16, so the
    whole stage computes in bf16 and sends bf16 activations (and receives bf16 gradients) over p2p.
    Gradients are reduce-scattered, and accumulated between reductions, in fp32 (`reduce_dtype`). The last
    stage returns fp32 outputs (`output_dtype`) so that `pipeline_loss` runs in fp32.
    Other precisions need no policy: "32-true" computes in fp32, "bf16-true" has bf16 parameters already.
    """
    if precision != "bf16-mixed":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32 if last_stage else None
    )
