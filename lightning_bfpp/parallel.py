# Scope: small functions over the (pipeline_parallel, data_parallel[, tensor_parallel]) DeviceMesh: build the mesh,
# shard a stage over data parallel (FSDP2), share a value over ranks, global-norm gradient clipping.
from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

PP, DP, TP = "pipeline_parallel", "data_parallel", "tensor_parallel"

# Process groups built under the current default group, by what they are: every Trainer run in a long-lived
# process (a notebook, an in-process sweep, a benchmark running many fits) reuses them instead of creating new
# communicators, whose threads (gloo: a few per group) and connections would pile up for the process's lifetime.
_GROUPS: dict[tuple, tuple[object, object]] = {}


def _once(key: tuple, make):
    """`make()` once per `key` under the current default process group (a new default group builds anew).
    NOTE: every rank calls this for the same keys in the same order (group creation is collective)."""
    world = dist.group.WORLD
    entry = _GROUPS.get(key)
    if entry is None or entry[0] is not world:
        entry = _GROUPS[key] = (world, make())
    return entry[1]


def forget_groups() -> None:
    """Build new groups from the next run on (after a failure, a group may hold a broken collective)."""
    _GROUPS.clear()


def shared_group(ranks: Collection[int], timeout: timedelta | None = None) -> dist.ProcessGroup:
    """``dist.new_group(ranks, timeout=...)``, made once per process (see `_once`)."""
    ranks = sorted(ranks)
    return _once(("group", tuple(ranks), timeout), lambda: dist.new_group(ranks, timeout=timeout))


def build_mesh(device_type: str, pipeline_parallel: int, world_size: int, timeout: timedelta | None = None,
               tensor_parallel: int = 1) -> DeviceMesh:
    """(pp, dp) mesh, dp innermost: the ranks of one data-parallel group are contiguous (same node); with
    `tensor_parallel` > 1, (pp, dp, tp) with tp innermost (one tensor-parallel group within a node).
    Its process groups get `timeout` (torch would give subgroups its 30 min default, not the world's). The same
    layout built again in this process returns the same mesh (its groups are made once, `_once`)."""
    if world_size % (pipeline_parallel * tensor_parallel):
        raise ValueError(
            f"pipeline_parallel x tensor_parallel = {pipeline_parallel} x {tensor_parallel} must divide the world size "
            f"({world_size} = devices x num_nodes)."
        )
    names = (PP, DP, TP) if tensor_parallel > 1 else (PP, DP)
    shape = (pipeline_parallel, world_size // (pipeline_parallel * tensor_parallel), tensor_parallel)[:len(names)]

    def make() -> DeviceMesh:
        if timeout is None:
            return init_device_mesh(device_type, shape, mesh_dim_names=names)
        grid = torch.arange(world_size).reshape(shape)
        return DeviceMesh.from_group(_dim_groups(grid, timeout), device_type, mesh=grid, mesh_dim_names=names)

    return _once(("mesh", device_type, shape, timeout), make)


def _dim_groups(ranks: torch.Tensor, timeout: timedelta) -> list[dist.ProcessGroup]:
    """For each dimension of the rank grid `ranks`, this rank's process group along it, created with `timeout`
    (public `new_subgroups_by_enumeration`: every rank creates every group of a dimension, in the same order)."""
    groups = []
    for dim in range(ranks.ndim):
        members = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
        mine, _ = dist.new_subgroups_by_enumeration(members, timeout=timeout)
        groups.append(mine)
    return groups


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
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip by the norm over ALL parameters of the model: torch's `get_total_norm` of the local stages' (sharded)
    grads, squared and summed over the pipeline group and, for sharded grads, the data-parallel group; then
    torch's `clip_grads_with_norm_`. Parameters whose id is in `not_counted`
    (extra copies of a shared weight) are scaled but left out of the norm. With `tp_group`, the parts of
    tensor-parallel-split grads are summed over it; grads every tp rank holds whole count once. Returns the total norm."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    from .tensor_parallel import sum_over_tp, tp_sharded

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


def share_from_ranks(value: torch.Tensor | None, divide_by: int, device: torch.device) -> torch.Tensor:
    """All-reduce (sum) a scalar that only some ranks have (others contribute 0), divided by `divide_by`.

    Used for the loss: only last-stage ranks hold it, one per data-parallel replica.
    """
    t = torch.zeros((), dtype=torch.float64, device=device) if value is None else value.detach().double().reshape(())
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return (t / divide_by).float()
