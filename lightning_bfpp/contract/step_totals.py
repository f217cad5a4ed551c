"""Totals over a whole training step, for a loss whose definition needs statistics of the whole batch (a router's
load-balancing loss multiplies the routing fractions of every layer and token). A micro-batch's loss adds its parts in
the forward (`StepTotals.add`); its backward reads the step's totals (`StepTotals.total`): the parts summed over every
micro-batch and data-parallel replica. That is exact where every forward of a step runs before its first backward
(``Schedule.forwards_first``: gpipe, breadth-first in one group); values computed from the totals are logged after
the step by the module's ``pipeline_step_logs``, under any schedule. Outside a pipeline step (one process,
``strategy="auto"``) no totals are active: the loss sees the whole batch at once and computes the statistics itself."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_ACTIVE: ContextVar[StepTotals | None] = ContextVar("bfpp_step_totals", default=None)
_SHAPES_ONLY: ContextVar[bool] = ContextVar("bfpp_shape_inference", default=False)


class StepTotals:
    """The parts a step's micro-batches add, and their totals. `reduce` sums a tensor over the data-parallel
    replicas in place (None: one replica); `needs_forwards_first` is raised (a message) when the schedule starts a
    backward before its last forward and totals are read while the step runs (they would miss micro-batches; read
    after the step, for its logs, they are complete). `router_loss`: the router loss's definition in this step
    (``contract.router_loss``: "batch" reads the totals in backward, "micro_batch" does not)."""

    def __init__(self, reduce: Callable[[torch.Tensor], None] | None = None, needs_forwards_first: str | None = None,
                 router_loss: str = "batch"):
        self.reduce = reduce
        self.needs_forwards_first = needs_forwards_first
        self.router_loss = router_loss
        self.running = False  # while `step_totals` has it active
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.totals: dict[str, torch.Tensor] | None = None

    def add(self, name: str, part: torch.Tensor) -> None:
        """A micro-batch's part of the total `name` (detached: totals carry no gradient)."""
        self.parts.setdefault(name, []).append(part.detach())

    def total(self, name: str) -> torch.Tensor:
        """The step's total of `name`, summed over micro-batches and replicas: on the first call (in the step's first
        backward), every part is reduced at once, in one collective."""
        if self.totals is None:
            if self.needs_forwards_first and self.running:
                raise RuntimeError(self.needs_forwards_first)
            names = sorted(self.parts)
            sums = [torch.stack(self.parts[n]).sum(0) for n in names]
            flat = torch.cat([s.reshape(-1).double() for s in sums]) if sums else torch.zeros(0, dtype=torch.float64)
            if self.reduce is not None and flat.numel():
                self.reduce(flat)
            self.totals, start = {}, 0
            for n, s in zip(names, sums):
                self.totals[n] = flat[start:start + s.numel()].reshape(s.shape).to(s.dtype)
                start += s.numel()
        return self.totals[name]


def active_step_totals() -> StepTotals | None:
    """The totals of the pipeline step being run, or None (one process: the loss sees the whole batch; and while
    torch's runtime calls a loss only to infer the backward's shapes, `shape_inference`)."""
    return None if _SHAPES_ONLY.get() else _ACTIVE.get()


@contextmanager
def shape_inference() -> Iterator[None]:
    """Around a forward or loss that torch's pipelining runtime runs only to infer shapes: its parts are not the
    step's."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


@contextmanager
def step_totals(totals: StepTotals) -> Iterator[StepTotals]:
    """`totals` active while a pipeline step runs (its forwards and backwards)."""
    token = _ACTIVE.set(totals)
    totals.running = True
    try:
        yield totals
    finally:
        totals.running = False
        _ACTIVE.reset(token)
