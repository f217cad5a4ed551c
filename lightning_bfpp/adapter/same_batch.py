"""The check that every rank of one data-parallel replica (its pipeline and tensor-parallel ranks) loaded the
same batch. The first stage runs on one rank's inputs and the loss (or the user's eval step) on another rank's
targets, so a loader that differs between processes (random augmentation without a seed, workers seeded by rank)
would silently pair one draw's inputs with another's targets."""
from __future__ import annotations

import math
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from ..dims import ParallelDims
from ..runtime.instrument import gather_rows

REL_TOL = 1e-9  # float64 sums of identical tensors agree exactly; this only absorbs a reduction's order


def fingerprint(value: Any) -> list[float]:
    """[element count, sum, position-weighted sum] over the tensors in `value`: equal for the same batch, different
    for another draw or the same samples in another order."""
    tensors: list[torch.Tensor] = []
    apply_to_collection(value, torch.Tensor, tensors.append)  # tuples, lists, dicts, dataclasses; other items ignored
    count, total, weighted = 0.0, 0.0, 0.0
    for t in tensors:
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64) % 1009 + 1
        count, total, weighted = (count + flat.numel(), total + float(flat.sum()),
                                  weighted + float((flat * weights).sum()))
    return [count, total, weighted]


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):  # a NaN in the batch: the same only if it is in both
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b), 1.0)


def check_same_batch(batch: Any, where: str, dims: ParallelDims, device: torch.device) -> None:
    """Raise on every rank (the same message) when the ranks of a data-parallel replica hold different batches
    (nothing to compare when a replica is one rank); each rank is compared with its replica's first rank."""
    if dims.pipeline_parallel * dims.context_parallel * dims.tensor_parallel == 1:
        return
    rows = gather_rows(fingerprint(batch), device)
    leaders = [dims.replica_leader(rank) for rank in range(len(rows))]
    differ = [(first, rank) for rank, (row, first) in enumerate(zip(rows, leaders))
              if not all(_same(a, b) for a, b in zip(row, rows[first]))]
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
