"""The DeviceMeshes of a layout (their shapes and names are ``dims.ParallelDims``': the model's, and with
expert parallel the experts') and the process groups over them, built once per process."""
from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..dims import DP, DP_CP, TP, ParallelDims

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


def build_mesh(dims: ParallelDims, device_type: str, timeout: timedelta | None = None) -> DeviceMesh:
    """The DeviceMesh of the validated layout `dims`: its shape and dimension names (``ParallelDims.mesh_shape``,
    ``mesh_dim_names``; dp innermost but for cp and tp, so the ranks of one context-parallel or tensor-parallel group
    are contiguous, one node). Its process groups get `timeout` (torch would give subgroups its 30 min default, not the
    world's). Under context parallel the parameters' mesh is built with it (``parameter_mesh``). The same layout built
    again in this process returns the same mesh (its groups are made once, `_once`)."""
    shape, names = dims.mesh_shape, dims.mesh_dim_names

    def make() -> DeviceMesh:
        if timeout is None:
            return init_device_mesh(device_type, shape, mesh_dim_names=names)
        grid = torch.arange(dims.world).reshape(shape)
        return DeviceMesh.from_group(_dim_groups(grid, timeout), device_type, mesh=grid, mesh_dim_names=names)

    mesh = _once(("mesh", device_type, shape, names, timeout), make)  # by names too: (pp, dp, cp) or (pp, dp, tp)
    if dims.context_parallel > 1:
        _once(("parameter mesh", id(mesh)), lambda: _parameter_mesh(dims, mesh, timeout))
    return mesh


def parameter_mesh(dims: ParallelDims, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh the parameters live on (``ParallelDims.parameter_mesh_dim_names``) for `mesh` (``build_mesh``'s):
    `mesh` itself, or under context parallel a second mesh over the same ranks whose dp and cp are one dimension
    (DP_CP): FSDP shards each stage over it, and gradients of every token are reduced over it."""
    if dims.context_parallel == 1:
        return mesh
    return _once(("parameter mesh", id(mesh)), lambda: _parameter_mesh(dims, mesh, None))


def _parameter_mesh(dims: ParallelDims, mesh: DeviceMesh, timeout: timedelta | None) -> DeviceMesh:
    """``parameter_mesh``, built with public APIs (``DeviceMesh.from_group``, as `build_mesh` does per dimension) from
    `mesh`'s own pipeline and tensor-parallel groups and a new group per dp x cp set of ranks
    (``ParallelDims.gradient_groups``; every rank creates every one, in the same order). Tensor parallel and FSDP both
    take their dimension of it, so FSDP sees one parent mesh."""
    shape, names = dims.parameter_mesh_shape, dims.parameter_mesh_dim_names
    mine, _ = dist.new_subgroups_by_enumeration(dims.gradient_groups(), timeout=timeout)
    groups = [mine if name == DP_CP else mesh[name].get_group() for name in names]
    grid = torch.arange(dims.world).reshape(shape)
    return DeviceMesh.from_group(groups, mesh.device_type, mesh=grid, mesh_dim_names=names)


def gradient_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dimension of a parameter mesh (``parameter_mesh``) over which gradients are reduced: dp, or dp x cp."""
    names = mesh.mesh_dim_names or ()
    return mesh[DP_CP] if DP_CP in names else mesh[DP]


def build_expert_mesh(dims: ParallelDims, mesh: DeviceMesh, device_type: str,
                      timeout: timedelta | None = None) -> DeviceMesh:
    """The experts' DeviceMesh of the validated layout `dims` (``ParallelDims.expert_mesh_shape`` and
    ``expert_mesh_dim_names``: PP, EDP, EP, and TP under tensor parallel), over the same ranks as the model's `mesh`,
    whose pipeline and tensor-parallel groups it reuses (new groups for the experts' copies and parts only). An expert's
    weights live on it: split over EP, FSDP-sharded over EDP (one mesh: FSDP requires both of a weight's meshes to
    share a root)."""
    names, ranks = dims.expert_mesh_dim_names, dims.expert_mesh_ranks()  # its shape: ``expert_mesh_shape``

    def make() -> DeviceMesh:
        grid = torch.tensor(ranks)  # (under context parallel not the ranks in order)
        tp = [mesh[TP].get_group()] if TP in names else []
        groups = [mesh.get_group(0), *_dim_groups(grid, timeout, first=1, stop=3), *tp]
        return DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=names)

    # by its ranks and names: the same shape lays out other ranks under context parallel, or has TP for its last dim
    return _once(("expert mesh", device_type, id(mesh), names, repr(ranks), timeout), make)


def _dim_groups(ranks: torch.Tensor, timeout: timedelta | None, first: int = 0,
                stop: int | None = None) -> list[dist.ProcessGroup]:
    """For each dimension of the rank grid `ranks` from `first` on (up to `stop`, not included), this rank's process
    group along it, created with `timeout` (public `new_subgroups_by_enumeration`: every rank creates every group of a
    dimension, in the same order)."""
    groups = []
    for dim in range(first, ranks.ndim if stop is None else stop):
        members = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
        mine, _ = dist.new_subgroups_by_enumeration(members, timeout=timeout)
        groups.append(mine)
    return groups


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (a DTensor's local tensor; any other tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t
