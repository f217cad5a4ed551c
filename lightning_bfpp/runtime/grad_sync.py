"""Data-parallel gradient all-reduce for replicated stages (sharding="none"), bucketed and issued per
stage at the schedule's REDUCE_GRAD point so that it overlaps the backward of the stages still to run."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .._private.pipelining import after_reduce_grad
from ..layout.mesh import local_tensor

BUCKET_BYTES = 25 * 2**20  # as DDP's bucket_cap_mb default: large enough to amortise each collective's latency


def buckets(grads: Iterable[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """`grads` in order, cut into runs of one dtype and device of at most `bucket_bytes` (or a single tensor)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        last = out[-1] if out else None
        if last is None or (last[0].dtype, last[0].device) != (g.dtype, g.device) or size + nbytes > bucket_bytes:
            out.append([g])
            size = nbytes
        else:
            last.append(g)
            size += nbytes
    return out


class BucketedAllReduce:
    """Averages the gradients of replicated stages over `group`.

    `attach(stage)` makes the stage's REDUCE_GRAD action (torch runs it right after the stage's last backward,
    where it also applies the 1/m scaling) start asynchronous all-reduces of the stage's gradients, flattened
    into buckets of at most `bucket_bytes` per dtype; `wait()`, at the end of the step, writes the averages back
    into the gradients. Elementwise the same sums as one all-reduce per parameter.
    """

    def __init__(self, group: dist.ProcessGroup, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.bucket_bytes = bucket_bytes
        self._pending: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = []

    def attach(self, stage) -> None:
        """Reduce `stage`'s gradients (a torch PipelineStage) as soon as its REDUCE_GRAD action has run."""
        after_reduce_grad(stage, lambda: self.start(stage.submod))

    def start(self, module: nn.Module) -> None:
        """Start the all-reduces of `module`'s gradients (asynchronous; `wait` finishes them)."""
        # a tensor-parallel DTensor's gradient: its local part (shares storage: the averages land in the DTensor)
        grads = [local_tensor(p.grad) for p in module.parameters() if p.grad is not None]
        for bucket in buckets(grads, self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self._pending.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, bucket))

    def wait(self) -> None:
        """Finish every started all-reduce and put the averaged gradients back (gloo has no AVG: sum, divide)."""
        for work, flat, bucket in self._pending:
            work.wait()
            flat.div_(self.size)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._pending = []
