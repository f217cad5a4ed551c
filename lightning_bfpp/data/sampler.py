"""The training order: each epoch a permutation of the samples (seeded by seed + epoch), cut into global batches;
each data-parallel replica reads its contiguous share of every global batch. The global batches are therefore the
same whatever the number of replicas, and a resume continues at the next sample of the checkpoint's epoch, at this
or another data-parallel size (``ResumableSampler.resume_at``)."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """Replica `rank` of `num_replicas`: its share of each global batch of `global_batch` samples (an incomplete last
    global batch is dropped). A DistributedSampler, so Lightning uses it as it is and calls ``set_epoch``.
    ``restores_position``: the epoch's first samples are skipped here on a resume (bfpp's own skip of the consumed
    batches leaves this sampler alone)."""

    restores_position = True

    def __init__(self, dataset: Dataset, global_batch: int, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        if global_batch % num_replicas:
            raise ValueError(f"the global batch of {global_batch} samples does not split over {num_replicas} "
                             "data-parallel replicas")
        self.global_batch, self.share = global_batch, global_batch // num_replicas
        self.batches = len(dataset) // global_batch  # global batches per epoch
        self.num_samples, self.total_size = self.batches * self.share, self.batches * global_batch
        self.resume_epoch, self.resume_samples = -1, 0

    def resume_at(self, epoch: int, samples: int) -> None:
        """Skip the first `samples` samples (whole global batches) of epoch `epoch` of the global order."""
        self.resume_epoch, self.resume_samples = epoch, samples

    def order(self) -> list[int]:
        """This epoch's global order."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        first = self.resume_samples // self.global_batch if self.epoch == self.resume_epoch else 0
        for batch in range(first, self.batches):
            start = batch * self.global_batch + self.rank * self.share
            yield from order[start:start + self.share]

    def __len__(self) -> int:
        return self.num_samples  # the whole epoch: Lightning's progress counts a resumed epoch's trained batches
