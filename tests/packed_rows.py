"""Windows that pack several documents (token batches with document ids, lightning_bfpp.contract.documents) for the
packing tests, and the one-process reference that runs each document alone: packed under bfpp, every document's
logits, loss and gradient must equal those of the document alone."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DistributedSampler

IGNORED = -100


class PackedRows(Dataset):
    """`samples` rows of `seq` random tokens, each packing 2 to 4 documents of random lengths (at least 2 tokens):
    {"input_ids", "labels", "document_ids"}, the target across a document boundary -100 (not counted)."""

    def __init__(self, samples: int, seq: int, vocab: int, seed: int = 11, labels: bool = True) -> None:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (samples, seq + 1), generator=g)
        documents = torch.zeros(samples, seq + 1, dtype=torch.long)
        for row in range(samples):
            cuts = torch.randperm(seq // 2 - 1, generator=g)[: int(torch.randint(1, 4, (1,), generator=g))] * 2 + 2
            for cut in cuts.tolist():
                documents[row, cut:] += 1
        targets = tokens[:, 1:].clone()
        targets[documents[:, 1:] != documents[:, :-1]] = IGNORED
        self.tensors = (tokens[:, :-1], targets, documents[:, :-1])
        self.labels = labels

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = {"input_ids": self.tensors[0][i], "document_ids": self.tensors[2][i]}
        return {**row, "labels": self.tensors[1][i]} if self.labels else row


def segments(documents: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each document in one row of document ids."""
    starts = [0] + [j for j in range(1, len(documents)) if documents[j] != documents[j - 1]]
    return list(zip(starts, starts[1:] + [len(documents)]))


def global_batches(ds: PackedRows, global_batch: int, data_parallel: int):
    """(input_ids, labels, document_ids) of the global batches Lightning's training sampler (shuffled, seed 0)
    yields over `data_parallel` replicas."""
    per_rank = [list(DistributedSampler(ds, num_replicas=data_parallel, rank=r, shuffle=True, seed=0))
                for r in range(data_parallel)]
    b = global_batch // data_parallel
    for t in range(len(per_rank[0]) // b):
        idx = [i for r in range(data_parallel) for i in per_rank[r][t * b:(t + 1) * b]]
        yield tuple(t[idx] for t in ds.tensors)


def alone_loss_sum(logits_of: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor, labels: torch.Tensor,
                   documents: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy over the counted targets of a batch, each document run alone (B=1, positions 0..)."""
    total = torch.zeros(())
    for row in range(len(input_ids)):
        for a, b in segments(documents[row]):
            logits = logits_of(input_ids[row:row + 1, a:b])[0]
            total = total + F.cross_entropy(logits, labels[row, a:b], ignore_index=IGNORED, reduction="sum")
    return total


def document_losses(logits: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor) -> list[float]:
    """Each document's mean loss over its counted targets, from the logits of packed rows."""
    losses = []
    for row in range(len(logits)):
        for a, b in segments(documents[row]):
            if (labels[row, a:b] != IGNORED).any():
                losses.append(F.cross_entropy(logits[row, a:b], labels[row, a:b], ignore_index=IGNORED).item())
    return losses
