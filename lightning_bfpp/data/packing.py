"""Windows of a token cache, as token batches' rows (``contract.documents``), over a range of whole documents (the
training and validation splits are split by documents: ``document_split``).

``documents`` (``TokenWindows(documents=True)``): the documents one after another, cut into windows of `block_size`
tokens; each row carries its document ids, so positions restart at each document and attention stays within it,
and the target across a boundary (the next document's first token) is not counted. ``concat``: the same windows
without document ids (attention crosses documents; every next token is a target). ``pad`` (``PaddedDocuments``):
one document per row, padded; padding is not counted, and a document longer than the window is an error. Prompt
tokens of prompt/completion and chat records are never counted (the cache's `trained` mask)."""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from ..contract.documents import IGNORED
from .cache import TokenCache
from .settings import DataError


def document_split(cache: TokenCache, val_fraction: float) -> tuple[range, range]:
    """(training documents, validation documents): the last `val_fraction` of the documents (at least one) are
    validation, in the files' order."""
    n = cache.num_documents
    val = min(n - 1, max(1, round(n * val_fraction))) if n > 1 else 0
    return range(0, n - val), range(n - val, n)


def _labels(cache: TokenCache, chunk: np.ndarray, start: int) -> np.ndarray:
    """Targets of chunk[:-1] (the next tokens, int64), -100 where the cache does not train the target."""
    labels = chunk[1:].astype(np.int64)
    if cache.trained is not None:
        labels[cache.trained[start + 1:start + len(chunk)] == 0] = IGNORED
    return labels


class TokenWindows(Dataset):
    """Windows of `block_size` tokens over the documents `documents` (contiguous), each with its next-token targets;
    `documents=True`: with document ids, targets across documents not counted (``packing=documents``)."""

    def __init__(self, cache: TokenCache, documents: range, block_size: int, with_documents: bool = True) -> None:
        self.cache, self.block_size, self.with_documents = cache, block_size, with_documents
        self.begin, self.end = int(cache.offsets[documents.start]), int(cache.offsets[documents.stop])
        self.length = max(0, (self.end - self.begin - 1) // block_size)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.length:
            raise IndexError(i)
        start = self.begin + i * self.block_size
        chunk = np.asarray(self.cache.tokens[start:start + self.block_size + 1])
        labels = _labels(self.cache, chunk, start)
        row = {"input_ids": torch.from_numpy(chunk[:-1].astype(np.int64))}
        if self.with_documents:
            # the document of every token of the chunk: the last offset at or before its position
            document = np.searchsorted(self.cache.offsets, np.arange(start, start + len(chunk)), side="right") - 1
            labels[document[1:] != document[:-1]] = IGNORED  # the next document's first token: not this one's target
            row["document_ids"] = torch.from_numpy(document[:-1] - document[0])
        row["labels"] = torch.from_numpy(labels)
        return row


class PaddedDocuments(Dataset):
    """One document per row (of the documents `documents` with at least one target), its first `block_size` tokens
    and their targets, padded with the cache's pad id (targets -100: ``packing=pad``)."""

    def __init__(self, cache: TokenCache, documents: range, block_size: int) -> None:
        self.cache, self.block_size = cache, block_size
        lengths = np.diff(cache.offsets[documents.start:documents.stop + 1])
        too_long = np.flatnonzero(lengths > block_size + 1)
        if len(too_long):
            d = documents.start + int(too_long[0])
            source, index = cache.document_source(d)
            raise DataError(
                f"data.packing=pad: document {index} of {source} has {int(lengths[too_long[0]])} tokens, more than "
                f"the window holds (data.block_size + 1 = {block_size + 1}; {len(too_long)} documents are longer); "
                "use data.packing=documents (long documents continue in the next window), or a larger "
                "model.block_size.")
        self.documents = documents.start + np.flatnonzero(lengths >= 2)
        self.pad = int(cache.meta["pad_id"])

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        d = int(self.documents[i])
        start, end = int(self.cache.offsets[d]), int(self.cache.offsets[d + 1])
        chunk = np.asarray(self.cache.tokens[start:end])
        input_ids = np.full(self.block_size, self.pad, dtype=np.int64)
        labels = np.full(self.block_size, IGNORED, dtype=np.int64)
        input_ids[:len(chunk) - 1] = chunk[:-1]
        labels[:len(chunk) - 1] = _labels(self.cache, chunk, start)
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}


def packed(cache: TokenCache, documents: range, block_size: int, packing: str) -> Dataset:
    """The rows of `documents` under data.packing (documents | concat | pad)."""
    if packing == "pad":
        return PaddedDocuments(cache, documents, block_size)
    return TokenWindows(cache, documents, block_size, with_documents=packing == "documents")
