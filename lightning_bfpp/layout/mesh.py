"""The DeviceMeshes of a layout (their shapes and names are ``schedule.dims.ParallelDims``': the model's, and with
expert parallel the experts') and the process groups over them, built once per process."""
from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..schedule.dims import ParallelDims

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
    ``mesh_dim_names``; dp innermost but for tp, so the ranks of one data-parallel or tensor-parallel group are
    contiguous, one node). Its process groups get `timeout` (torch would give subgroups its 30 min default, not the
    world's). The same layout built again in this process returns the same mesh (its groups are made once, `_once`)."""
    shape, names = dims.mesh_shape, dims.mesh_dim_names

    def make() -> DeviceMesh:
        if timeout is None:
            return init_device_mesh(device_type, shape, mesh_dim_names=names)
        grid = torch.arange(dims.world).reshape(shape)
        return DeviceMesh.from_group(_dim_groups(grid, timeout), device_type, mesh=grid, mesh_dim_names=names)

    return _once(("mesh", device_type, shape, timeout), make)


def build_expert_mesh(dims: ParallelDims, mesh: DeviceMesh, device_type: str,
                      timeout: timedelta | None = None) -> DeviceMesh:
    """The experts' DeviceMesh of the validated layout `dims` (``ParallelDims.expert_mesh_shape`` and
    ``expert_mesh_dim_names``: PP, EDP, EP), over the same ranks as the model's `mesh`, whose pipeline groups it
    reuses (new groups for the experts' copies and parts only). An expert's weights live on it: split over EP,
    FSDP-sharded over EDP (one mesh: FSDP requires both of a weight's meshes to share a root)."""
    shape, names = dims.expert_mesh_shape, dims.expert_mesh_dim_names

    def make() -> DeviceMesh:
        grid = torch.arange(dims.world).reshape(shape)
        groups = [mesh.get_group(0), *_dim_groups(grid, timeout, first=1)]
        return DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=names)

    return _once(("expert mesh", device_type, shape, timeout), make)


def _dim_groups(ranks: torch.Tensor, timeout: timedelta | None, first: int = 0) -> list[dist.ProcessGroup]:
    """For each dimension of the rank grid `ranks` from `first` on, this rank's process group along it, created with
    `timeout` (public `new_subgroups_by_enumeration`: every rank creates every group of a dimension, in the same
    order)."""
    groups = []
    for dim in range(first, ranks.ndim):
        members = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
        mine, _ = dist.new_subgroups_by_enumeration(members, timeout=timeout)
        groups.append(mine)
    return groups


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (a DTensor's local tensor; any other tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t
