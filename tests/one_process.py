"""The one-process reference loop every exactness test trains its plain model with, and the float64 it runs in.

One loop for every model (the test StackNet, the example GPT, Hugging Face models): the same data order as
Lightning's sampler (the caller's batches), each optimizer step over its `accumulate` batches training the mean over
their counted items (bfpp's loss rule, ``runtime.pipeline.CountedLoss``; a plain mean loss counts one item per batch,
so it is averaged over the batches), optional clipping by the whole model's norm, then the optimizer's step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

Batch = Any
# What a reference's loss function returns for one batch: (the loss summed over the batch's counted items, as trained;
# the number of items it counts; the loss logged for the batch, as bfpp's train_loss shows it)
BatchLoss = tuple[torch.Tensor, int | torch.Tensor, float]


def as_float64(model: nn.Module) -> nn.Module:
    """`model` as a precision="64-true" run has it: built (and initialized) in float32, then cast to float64, as
    Lightning's DoublePrecision plugin casts the run's model."""
    return model.double()


def float64_batch(batch: Any) -> Any:
    """A batch's floating tensors in float64 (what DoublePrecision's ``convert_input`` gives the run); token ids and
    targets keep their integer type."""
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(float64_batch(b) for b in batch)
    if isinstance(batch, dict):
        return {k: float64_batch(v) for k, v in batch.items()}
    return batch


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: Iterable[Sequence[Batch]],
          loss: Callable[[nn.Module, Batch], BatchLoss], *, clip: float | None = None,
          skip: frozenset[int] = frozenset(), micro_batches: int = 1) -> list[float]:
    """Train `model` one optimizer step per item of `steps` (that step's batches, in order); returns every batch's
    logged loss. Each step's gradient is the sum of its batches' summed losses over the step's counted items.

    As bfpp computes it: each of the batch's `micro_batches` equal parts (rows) differentiated on its own (a
    whole-batch loss, e.g. a router loss over the batch, needs 1), and the division by the step's items applied to the
    gradients after the backward passes. The order matters where a model computes in float32 inside a float64 run
    (Llama's norms cast their gradients to float32, Gemma 3's sum their weights' gradients in float32): its roundings
    then fall where the run's do. Batches whose index (over the whole run) is in `skip` are drawn and logged but give
    no gradient (a skipped non-finite batch: its step changes nothing)."""
    logged: list[float] = []
    for batches in steps:
        optimizer.zero_grad()
        items = 0
        for batch in batches:
            if _is_float64(model):
                batch = float64_batch(batch)
            parts = [loss(model, part) for part in _split(batch, micro_batches)]
            for summed, _, _ in parts:
                if len(logged) not in skip:
                    summed.backward()
            counted = sum(int(n) for _, n, _ in parts)
            logged.append(sum(float(shown) * int(n) for _, n, shown in parts) / max(counted, 1))
            items += counted
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(max(items, 1))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return logged


def _split(batch: Batch, parts: int) -> list[Batch]:
    """`batch` (a tensor, or a tuple / list / dict of tensors with the same rows) in `parts` equal parts of rows."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        assert batch.shape[0] % parts == 0, f"{batch.shape[0]} rows do not split into {parts} micro-batches"
        return list(batch.chunk(parts))
    if isinstance(batch, dict):
        chunks = {k: _split(v, parts) for k, v in batch.items()}
        return [{k: c[i] for k, c in chunks.items()} for i in range(parts)]
    return [type(batch)(c) for c in zip(*(_split(b, parts) for b in batch))]


def mean_batch_loss(mean: torch.Tensor) -> BatchLoss:
    """A plain mean-reduced loss as one item: averaged over a step's batches, logged as it is."""
    return mean, 1, mean.item()


def _is_float64(model: nn.Module) -> bool:
    return any(p.dtype == torch.float64 for p in model.parameters())
