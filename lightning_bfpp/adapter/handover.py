"""Handing the gradients a pipeline schedule computes inside Lightning's `training_step` over to
Lightning's `backward`, so Lightning's accumulation, clipping, hooks and optimizer step see them."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


class GradHandover:
    """Fresh gradients parked between `training_step` and `backward`.

    With automatic optimization Lightning's closure calls ``training_step`` -> ``zero_grad`` (first batch of
    an accumulation window) -> ``backward``. The schedule already ran backward inside ``training_step``, so
    its gradients are parked (`capture`) and added back in ``backward`` (`hand_over`).
    NOTE: this relies on that closure order of Lightning 2.6; ``tests/test_handover.py`` fails if it changes
    (the reason for the ``lightning<2.7`` pin).
    """

    def __init__(self) -> None:
        self.fresh: list[tuple[nn.Parameter, torch.Tensor | None]] = []

    @contextmanager
    def capture(self, params: Sequence[nn.Parameter]) -> Iterator[None]:
        """Around the schedule: gradients of earlier accumulation batches are set aside (kept out of the
        schedule's 1/m scaling), the fresh ones parked afterwards, and the earlier ones put back."""
        previous = [p.grad for p in params]
        earlier = any(g is not None for g in previous)  # none in the first batch of an accumulation window
        if earlier:
            for p in params:
                p.grad = None
        try:
            yield
            self.fresh = [(p, p.grad) for p in params]
        finally:
            for p, g in zip(params, previous):
                if earlier or g is not p.grad:
                    p.grad = g

    def drop(self) -> None:
        """Hand nothing over (a skipped batch); parameters without gradients are not stepped."""
        self.fresh = []

    def grads(self) -> list[torch.Tensor | None]:
        return [g for _, g in self.fresh]

    def hand_over(self, scale: float) -> None:
        """Add the parked gradients, times `scale` (1 / accumulate_grad_batches, as Lightning divides the
        loss), to whatever the parameters hold."""
        for p, g in self.fresh:
            if g is None:
                continue
            g = g * scale if scale != 1.0 else g
            p.grad = g if p.grad is None else p.grad + g
        self.fresh = []
