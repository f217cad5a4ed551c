"""The user's training dataloader checked against the layout before the first step: its batch splits into the
micro-batches, it yields each replica's share of global_batch_size, and a ragged last batch is named in advance."""
from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ..layout.plan import LayoutPlan
from ..schedule.dims import LayoutError, Names


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


def check_training_loader(dataloader: object, plan: LayoutPlan) -> None:
    """Raise when (with global_batch_size) the training loader's batch is not this replica's share; warn when an
    epoch ends on a batch that will not split into the micro-batches."""
    batch_size = getattr(dataloader, "batch_size", None)
    if isinstance(batch_size, int) and plan.global_batch_size and batch_size != plan.replica_batch_size:
        raise LayoutError(
            f"the training dataloader's batch_size={batch_size} (per data-parallel replica) x data_parallel="
            f"{plan.dims.data_parallel} is not global_batch_size={plan.global_batch_size}: build the loader with "
            f"batch_size=trainer.strategy.replica_batch_size ({plan.replica_batch_size}), e.g. in a datamodule's "
            "setup/train_dataloader, so the optimizer sees the same batch whatever the layout.")
    tail = ragged_tail(dataloader)
    if tail and tail % plan.spec.micro_batches:
        rank_zero_warn(
            f"the training dataloader's last batch of each epoch has {tail} samples (per data-parallel replica), "
            f"not a multiple of micro_batches={plan.spec.micro_batches}: the step that reaches it will stop with "
            "an error. Set drop_last=True on the training loader (evaluation loaders may keep a ragged last batch).")
