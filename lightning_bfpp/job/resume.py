"""Exact mid-epoch resume for ordinary (map-style) training dataloaders. Lightning restores the
loop's batch progress but restarts a non-stateful dataloader at the epoch's first batch; here the
batch *indices* already consumed in the epoch are skipped (no data is loaded for them)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader


class SkipFirstBatches(BatchSampler):
    """A batch sampler that drops the first `skip` batches of its next epoch only."""

    def __init__(self, inner, skip: int):  # inner: the DataLoader's batch sampler
        self.inner, self.skip = inner, skip
        self.sampler = getattr(inner, "sampler", None)  # Lightning calls sampler.set_epoch() through this
        self.batch_size = getattr(inner, "batch_size", None)
        self.drop_last = getattr(inner, "drop_last", False)

    def __len__(self) -> int:
        return len(self.inner)  # the epoch keeps its length: the loop's progress already counts the skipped

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        for i, batch in enumerate(self.inner):
            if i >= skip:
                yield batch


def resume_training_loader(dataloader: object, fit_loop: Any) -> object:
    """On a mid-epoch resume of Lightning's `fit_loop`, `dataloader` started after the batches the checkpoint had
    trained on (`processed`: a ModelCheckpoint saving in on_train_batch_end has not yet counted its batch
    `completed`); otherwise `dataloader` as it is. A checkpoint of an epoch's end (its last batch,
    on_train_epoch_end, or a finished epoch) resumes at the next epoch's start, as Lightning's restart stages say."""
    if fit_loop.restarting and mid_epoch(fit_loop):
        return skip_consumed_batches(dataloader, fit_loop.epoch_loop.batch_progress.current.processed)
    return dataloader


def mid_epoch(fit_loop: Any) -> bool:
    """Whether Lightning's `fit_loop`, saved now, resumes inside its epoch (after its `processed` batches) rather than
    at the next epoch's start (at an epoch's last batch, in on_train_epoch_end, or after fit ends)."""
    batches, epochs = fit_loop.epoch_loop.batch_progress, fit_loop.epoch_progress.current
    return epochs.processed < epochs.ready and not batches.is_last_batch


def skip_consumed_batches(dataloader: object, consumed: int) -> object:
    """Return a DataLoader equivalent to `dataloader` that starts `consumed` batches into the epoch."""
    if consumed <= 0 or not isinstance(dataloader, DataLoader) or dataloader.batch_sampler is None:
        return dataloader
    if hasattr(dataloader, "state_dict") and hasattr(dataloader, "load_state_dict"):
        return dataloader  # stateful loaders resume themselves through Lightning
    if getattr(dataloader.sampler, "restores_position", False):
        return dataloader  # a sampler that skips the consumed samples itself (lightning_bfpp.data.ResumableSampler)
    return DataLoader(
        dataloader.dataset,
        batch_sampler=SkipFirstBatches(dataloader.batch_sampler, consumed),
        num_workers=dataloader.num_workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        prefetch_factor=dataloader.prefetch_factor,
        persistent_workers=dataloader.persistent_workers,
    )
