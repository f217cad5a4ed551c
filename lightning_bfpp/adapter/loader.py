"""The user's training dataloader checked against the layout before the first step: its batch splits into the
micro-batches, it yields each replica's share of global_batch_size, and a ragged last batch that would not split is
refused before training when the run would reach it (evaluation loaders may end ragged: they run it as fewer
micro-batches)."""
from __future__ import annotations

from typing import Any

from ..dims import LayoutError, Names
from ..layout.plan import LayoutPlan


def ragged_tail(dataloader: object) -> int:
    """Samples in a map-style loader's short last batch (0: none, or unknown)."""
    batch_size, sampler = getattr(dataloader, "batch_size", None), getattr(dataloader, "sampler", None)
    if not isinstance(batch_size, int) or getattr(dataloader, "drop_last", True) or not hasattr(sampler, "__len__"):
        return 0
    return len(sampler) % batch_size


def check_split(dataloader: object, plan: LayoutPlan) -> None:
    """Raise when the loader's batch does not split into the schedule's micro-batches."""
    batch_size = getattr(dataloader, "batch_size", None)
    if isinstance(batch_size, int):
        plan.dims.micro_batch_size(batch_size, Names(replica_batch="the dataloader's batch_size"))


def reaches_last_batch(trainer: Any, batches: int) -> bool:
    """Whether the run trains an epoch's last batch (of `batches`): not when ``limit_train_batches`` cuts the epoch
    short, nor when ``max_steps`` ends the run within its first epoch."""
    limit = getattr(trainer, "limit_train_batches", 1.0)
    used = min(limit, batches) if isinstance(limit, int) else int(batches * (1.0 if limit is None else limit))
    max_steps, accumulate = getattr(trainer, "max_steps", -1), getattr(trainer, "accumulate_grad_batches", 1)
    return used >= batches and not (0 < max_steps and max_steps * accumulate < batches)


def check_training_loader(dataloader: object, plan: LayoutPlan, trainer: Any = None) -> None:
    """Raise when (with global_batch_size) the training loader's batch is not this replica's share, or when an
    epoch ends on a batch that will not split into the micro-batches and `trainer`'s run reaches it."""
    batch_size = getattr(dataloader, "batch_size", None)
    if isinstance(batch_size, int) and plan.global_batch_size and batch_size != plan.replica_batch_size:
        raise LayoutError(
            f"the training dataloader's batch_size={batch_size} (per data-parallel replica) x data_parallel="
            f"{plan.dims.data_parallel} is not global_batch_size={plan.global_batch_size}: build the loader with "
            f"batch_size=trainer.strategy.replica_batch_size ({plan.replica_batch_size}), e.g. in a datamodule's "
            "setup/train_dataloader, so the optimizer sees the same batch whatever the layout.")
    tail, m = ragged_tail(dataloader), plan.spec.micro_batches
    if tail and tail % m and reaches_last_batch(trainer, len(dataloader)):
        samples = len(dataloader.sampler)
        raise LayoutError(
            f"the training dataloader's last batch of each epoch would have {tail} samples ({samples} samples per "
            f"data-parallel replica in batches of {batch_size}), not a multiple of micro_batches={m}, so that step "
            f"could not run: set drop_last=True on the training loader (each epoch then leaves those {tail} samples "
            "out), or a batch_size that divides the samples. Evaluation loaders may keep a ragged last batch.")
