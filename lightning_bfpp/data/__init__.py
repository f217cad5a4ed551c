"""Text data for causal language models: local files (or a dataset on the Hugging Face hub) read with Hugging Face
``datasets``, tokenized once into a memory-mapped token cache (``cache``: ``prepare_tokens``), packed into windows
with or without document boundaries (``packing``), drawn in an order that a checkpoint resumes (``sampler``), as a
LightningDataModule (``module``: ``TextDataModule``). Plain text, prompt/completion and chat records (``encode``).
Batches are token batches (``contract.documents``). Needs `pip install lightning-bfpp[data]`.

May import: contract (the token batch format), job (Lightning's mid-epoch resume rule).
"""
from __future__ import annotations

import importlib
from typing import Any

# re-exported, each loaded on first use (``settings`` alone imports nothing heavy: the app's checks read it)
_LAZY = {"TokenCache": ".cache", "prepare_tokens": ".cache", "TextDataModule": ".module", "FORMATS": ".settings",
         "PACKINGS": ".settings", "DataError": ".settings", "TextSettings": ".settings"}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
