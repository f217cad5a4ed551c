# Scope: the check that every rank of one data-parallel replica (its pipeline and tensor-parallel ranks) loaded the
# same batch. The first stage runs on one rank's inputs and the loss (or the user's eval step) on another rank's
# targets, so a loader that differs between processes (random augmentation without a seed, workers seeded by rank)
# would silently pair one draw's inputs with another's targets.
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

REL_TOL = 1e-9  # float64 sums of identical tensors agree exactly; this only absorbs a reduction's order


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def fingerprint(value: Any) -> list[float]:
    """[element count, sum, position-weighted sum] over the tensors in `value`: equal for the same batch, different
    for another draw or the same samples in another order."""
    count, total, weighted = 0.0, 0.0, 0.0
    for t in _tensors(value):
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64) % 1009 + 1
        count, total, weighted = count + flat.numel(), total + float(flat.sum()), weighted + float((flat * weights).sum())
    return [count, total, weighted]


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):  # a NaN in the batch: the same only if it is in both
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b), 1.0)


def check_same_batch(batch: Any, where: str, data_parallel: int, tensor_parallel: int, device: torch.device) -> None:
    """Raise on every rank (the same message) when the ranks of a data-parallel replica hold different batches.
    Ranks are laid out (pp, dp, tp), tp innermost: rank r belongs to replica (r // tp) % dp."""
    mine = torch.tensor(fingerprint(batch), dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    rows = torch.stack(every).cpu().tolist()
    differ = []
    for rank, row in enumerate(rows):
        first = next(r for r in range(len(rows)) if (r // tensor_parallel) % data_parallel == (rank // tensor_parallel) % data_parallel)
        ref = rows[first]
        if not all(_same(a, b) for a, b in zip(row, ref)):
            differ.append((first, rank))
    if differ:
        pairs = ", ".join(f"rank {b} vs rank {a}" for a, b in differ[:4])
        raise RuntimeError(
            f"bfpp: the {where} batch differs between ranks that must load the same one ({pairs}): the first pipeline "
            "stage runs on one rank's inputs and the loss or your step on another rank's targets. The loader or "
            "dataset draws differently in each process: seed every random transform by the sample's index (or "
            "draw it in the model), and keep the sampler's and the workers' seeds equal across processes "
            "(seed_everything(seed) in every process; seed_everything(seed, workers=True) seeds each rank's "
            "workers differently)."
        )
