# Scope: small functions over the (pipeline_parallel, data_parallel) DeviceMesh: build the mesh,
# shard a stage over data parallel (FSDP2), share a value over ranks, global-norm gradient clipping.
from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

PP, DP = "pipeline_parallel", "data_parallel"


def build_mesh(device_type: str, pipeline_parallel: int, world_size: int, timeout: timedelta | None = None) -> DeviceMesh:
    """(pp, dp) mesh, dp innermost: the ranks of one data-parallel group are contiguous (same node).
    Its process groups get `timeout` (torch would give subgroups its 30 min default, not the world's)."""
    if world_size % pipeline_parallel:
        raise ValueError(
            f"pipeline_parallel={pipeline_parallel} must divide the world size ({world_size} = devices x num_nodes)."
        )
    override = None
    if timeout is not None:
        from torch._C._distributed_c10d import Backend

        backend = dist.get_backend()
        options = Backend.Options(backend)
        options._timeout = timeout
        override = {PP: (backend, options), DP: (backend, options)}
    return init_device_mesh(device_type, (pipeline_parallel, world_size // pipeline_parallel), mesh_dim_names=(PP, DP),
                            backend_override=override)


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


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def clip_grad_norm_global(
    params: Iterable[nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
    not_counted: Collection[int] = (),
) -> torch.Tensor:
    """Clip by the norm over ALL parameters of the model: local stages' (sharded) grads, summed over the
    pipeline group and, for sharded grads, the data-parallel group. Parameters whose id is in `not_counted`
    (extra copies of a shared weight) are scaled but left out of the norm. Returns the total norm."""
    params = [p for p in params if p.grad is not None]
    grads = [local_tensor(p.grad) for p in params]
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p, g in zip(params, grads):
        if id(p) not in not_counted:
            sq += g.detach().double().pow(2).sum()
    for group in (pp_group, dp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total


def share_from_ranks(value: torch.Tensor | None, divide_by: int, device: torch.device) -> torch.Tensor:
    """All-reduce (sum) a scalar that only some ranks have (others contribute 0), divided by `divide_by`.

    Used for the loss: only last-stage ranks hold it, one per data-parallel replica.
    """
    t = torch.zeros((), dtype=torch.float64, device=device) if value is None else value.detach().double().reshape(())
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return (t / divide_by).float()
