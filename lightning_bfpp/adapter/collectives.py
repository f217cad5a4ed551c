"""The strategy's collectives as a LightningModule uses them (`self.all_gather`, `sync_dist`,
`trainer.strategy.reduce / barrier / broadcast`). Under DDP "all ranks" are the data-parallel replicas; under
bfpp every pipeline (and tensor-parallel) rank of a replica holds the replica's values, so the module's
gathers and reductions run over the data-parallel group: the results DDP gives with that many replicas.
Inside a user step, which runs on the last stage's ranks only, the barrier and broadcast run over that group
too (over the world they would wait for ranks that never come)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .._private.lightning_api import all_gather_if_distributed, sync_if_distributed
from ..dims import DP


class ReplicaCollectives:
    """Mixin for the strategy (needs ModelParallelStrategy's `_device_mesh`, `root_device`, `world_size`
    and collectives)."""

    _in_last_stage_step = False

    def _replica_group(self) -> dist.ProcessGroup | None:
        mesh = self._device_mesh  # ModelParallelStrategy's; None until setup_environment builds the mesh
        return mesh[DP].get_group() if mesh is not None and dist.is_initialized() else None

    @contextmanager
    def last_stage_step(self) -> Iterator[None]:
        """Around a user step that runs on the last stage's ranks only."""
        self._in_last_stage_step = True
        try:
            yield
        finally:
            self._in_last_stage_step = False

    def _group(self, group: Any | None) -> Any | None:
        """The replicas' group for "all ranks" (None, or the world group LightningModule.all_gather passes)."""
        return self._replica_group() if group is None or group is dist.group.WORLD else group

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """One entry per data-parallel replica (as DDP with that many ranks), unless another group is given."""
        return all_gather_if_distributed(tensor, group=self._group(group), sync_grads=sync_grads)

    def reduce(self, tensor: torch.Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> torch.Tensor | Any:
        """Over the data-parallel replicas (sync_dist at epoch end: a sum counts each replica once), unless a
        group is given."""
        if isinstance(tensor, torch.Tensor):
            return sync_if_distributed(tensor, self._group(group), reduce_op=reduce_op)
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002  (Lightning's signature)
        """Every rank's vote (a callback may decide per rank): over the world, as Lightning's."""
        if not dist.is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(votes, op=ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes > 0)

    def barrier(self, name: str | None = None) -> None:
        if self._in_last_stage_step:
            on_gpu = self.root_device.type == "cuda"
            dist.barrier(group=self._replica_group(), device_ids=[self.root_device.index] if on_gpu else None)
        else:
            super().barrier(name)  # type: ignore[misc]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Inside a user step `src` is a data-parallel rank (a replica), as under DDP."""
        if not self._in_last_stage_step:
            return super().broadcast(obj, src)  # type: ignore[misc]
        box = [obj]
        dist.broadcast_object_list(box, group=self._replica_group(), group_src=src)
        return box[0]
