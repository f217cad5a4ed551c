"""Values and norms reduced over the mesh: the loss only the last stage's ranks hold, shared with every rank,
and gradient clipping by the whole model's norm (pipeline, data-parallel and tensor-parallel parts counted once)."""
from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..dims import PP, TP, ParallelDims
from ..layout.mesh import gradient_mesh, local_tensor
from ..layout.tensor_parallel import sum_over_tp, tp_sharded
from .pipeline import StepLoss


def clip_grad_norm_global(
    params: Iterable[nn.Parameter],
    max_norm: float,
    pp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
    not_counted: Collection[int] = (),
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip by the norm over ALL parameters of the model: torch's `get_total_norm` of the local stages' (sharded) grads,
    squared and summed over the pipeline group and, for sharded grads, the data-parallel group; then torch's
    `clip_grads_with_norm_`. Parameters whose id is in `not_counted` (extra copies of a shared weight) are scaled but
    left out of the norm. With `tp_group`, the parts of tensor-parallel-split grads are summed over it; grads every tp
    rank holds whole count once. Returns the total norm."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")

    def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:  # float64: squares of ranks' norms add up
        return get_total_norm(grads).double() ** 2 if grads else torch.zeros((), dtype=torch.float64, device=device)

    counted = [p for p in params if id(p) not in not_counted]
    split = [p for p in counted if tp_group is not None and tp_sharded(p.grad)]  # parts summed over tp
    whole = [p for p in counted if not (tp_group is not None and tp_sharded(p.grad))]
    sq = squared_norm([local_tensor(p.grad) for p in whole]) + sum_over_tp(
        squared_norm([local_tensor(p.grad) for p in split]), tp_group)
    for group in (pp_group, dp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
    total = sq.sqrt()
    by_mesh: dict[DeviceMesh | None, list[nn.Parameter]] = {}  # DTensor grads are scaled by a DTensor norm
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for mesh, members in by_mesh.items():
        clip_grads_with_norm_(members, max_norm, total if mesh is None else _replicated(total, mesh))
    return total


def _replicated(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`t` (the same value on every rank) as a DTensor replicated over `mesh`."""
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def share_loss(loss: StepLoss | None, dims: ParallelDims, device: torch.device,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, float | None]:
    """A training step's loss on every rank, from the ranks holding the last stage (one per replica, context- and
    tensor-parallel rank; the others pass None): (the mean micro-batch loss averaged over replicas and context-parallel
    shards, None), or for counted items (``StepLoss.items``) (the mean over every counted item of the global batch,
    their number; 0 when none counts: each context-parallel rank counts the targets of its own shard, so summing counts
    every target once). Summed in float64, returned as `dtype` (the run's floating type: float64 under
    precision="64-true", so no rank rounds it to float32). One all-reduce over the world; one process shares nothing
    (no collective, and no host sync for a mean loss)."""
    if loss is not None and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        if loss.items is None:
            return loss.value.detach().to(dtype), None
        items = float(loss.items)
        return (loss.value.detach().double() / max(items, 1.0)).to(dtype), items
    t = torch.zeros(3, dtype=torch.float64, device=device)
    if loss is not None:
        t[0] = loss.value.detach().double()
        if loss.items is not None:
            t[1], t[2] = loss.items.double(), 1.0
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    total, items, counted = (t / dims.tensor_parallel).tolist()  # each tp rank holds the same loss
    if not counted:
        return (t[0] / (dims.gradient_replicas * dims.tensor_parallel)).to(dtype), None
    return (t[0] / dims.tensor_parallel / max(items, 1.0)).to(dtype), items


def clip_grad_norm_on_mesh(params: Iterable[nn.Parameter], max_norm: float, *, mesh: DeviceMesh, sharded: bool,
                           tied: Any = None) -> torch.Tensor:
    """`clip_grad_norm_global` over the parameters' (pp, dp[, tp]) `mesh` (``layout.mesh.parameter_mesh``: dp x cp
    under context parallel): the pipeline group, the data-parallel group when the gradients are `sharded`, the
    tensor-parallel group when the mesh has one; the copies of a weight shared across stages
    (``layout.tied.TiedWeights`` `tied`) count once."""
    not_counted = tied.not_counted() if tied is not None else set()
    dp_group = gradient_mesh(mesh).get_group() if sharded else None
    tp_group = mesh[TP].get_group() if TP in (mesh.mesh_dim_names or ()) else None
    return clip_grad_norm_global(params, max_norm, mesh[PP].get_group(), dp_group, not_counted, tp_group)
