"""``TextDataModule``: a token cache (prepared once, ``cache``) as training and validation loaders of token batches,
packed as asked (``packing``), the training order resumable from a checkpoint (``sampler``): the data position
(epoch, samples of it consumed, seed) is the datamodule's state, which Lightning keeps in every checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from ..job.resume import mid_epoch
from .cache import TokenCache, prepare_tokens
from .packing import document_split, packed
from .sampler import ResumableSampler
from .settings import PACKINGS, DataError, TextSettings


class TextDataModule(L.LightningDataModule):
    """Text (or prompt/completion, or chat) records tokenized into a token cache, packed into windows of `block_size`
    tokens: rows ``{"input_ids", "labels", "document_ids"}`` (``packing="documents"``: each document attends only
    within itself), ``{"input_ids", "labels"}`` (``"concat"``, ``"pad"``).

    `batch_size` is the global batch of one step; each data-parallel replica loads its share (the strategy's
    ``distributed_sampler_kwargs``; `data_parallel` to give it). Validation: the last `val_fraction` of the documents.
    The data position is resumed from a checkpoint at any data-parallel size that splits the same global batch.

    Args:
        settings: the records, the tokenizer and the cache (``TextSettings``); or give its fields as keywords.
    """

    def __init__(self, settings: TextSettings | None = None, *, block_size: int, batch_size: int = 32,
                 packing: str = "documents", val_fraction: float = 0.05, seed: int = 1234, num_workers: int = 0,
                 data_parallel: int | None = None, **settings_fields: Any) -> None:
        super().__init__()
        if packing not in PACKINGS:
            raise DataError(f"data.packing={packing!r} is not one of {', '.join(PACKINGS)}.")
        self.settings = settings if settings is not None else TextSettings(**settings_fields)
        self.block_size, self.batch_size, self.packing = block_size, batch_size, packing
        self.val_fraction, self.seed, self.num_workers = val_fraction, seed, num_workers
        self.data_parallel = data_parallel
        self.cache: TokenCache | None = None
        self.train_set = self.val_set = None
        self._resume: dict[str, Any] | None = None

    def prepare_data(self) -> None:
        prepare_tokens(self.settings, checksums=False)

    def setup(self, stage: str | None = None) -> None:
        if self.cache is None:
            self.cache = prepare_tokens(self.settings, checksums=False)  # one process prepares; the others wait
            train, val = document_split(self.cache, self.val_fraction)
            self.train_set = packed(self.cache, train, self.block_size, self.packing)
            self.val_set = packed(self.cache, val, self.block_size, self.packing)

    def _replicas(self) -> dict[str, int]:
        """This process's replica: the strategy's ``distributed_sampler_kwargs``, else `data_parallel` (rank 0)."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
        if kwargs:
            return {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]}
        return {"num_replicas": self.data_parallel or 1, "rank": 0}

    def train_dataloader(self) -> DataLoader:
        replicas = self._replicas()
        sampler = ResumableSampler(self.train_set, self.batch_size, seed=self.seed, **replicas)
        if self._resume is not None:
            sampler.resume_at(self._resume["epoch"], self._resume["samples"])
            self._resume = None
        return DataLoader(self.train_set, batch_size=sampler.share, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        share = self.batch_size // self._replicas()["num_replicas"]
        return DataLoader(self.val_set, batch_size=share, shuffle=False, drop_last=True, num_workers=self.num_workers)

    # ---- the data position, in every checkpoint (Lightning saves and restores a datamodule's state) ----
    def state_dict(self) -> dict[str, Any]:
        """Epoch, samples of it trained (the batches Lightning counts as processed x the global batch), seed."""
        if self.trainer is None or self.train_set is None:
            return {}
        loop = self.trainer.fit_loop
        # (Lightning resumes at the next epoch's start when saved at an epoch's end or after fit: nothing consumed)
        processed = loop.epoch_loop.batch_progress.current.processed if mid_epoch(loop) else 0
        return {"epoch": self.trainer.current_epoch, "samples": processed * self.batch_size, "seed": self.seed,
                "global_batch_size": self.batch_size, "train_samples": len(self.train_set),
                "cache": Path(self.cache.path).name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the checkpoint's data position: the same global batch (any data-parallel size that splits it), the
        same training samples; the checkpoint's seed continues its order."""
        if not state:
            return
        if state["global_batch_size"] != self.batch_size:
            raise DataError(
                f"the checkpoint's data position counts global batches of data.batch_size={state['global_batch_size']}"
                f", this run's are {self.batch_size}: resume with data.batch_size={state['global_batch_size']} (at any "
                "data-parallel size that splits it), or start fresh (ckpt_path=null).")
        if state["train_samples"] != len(self.train_set):
            raise DataError(
                f"the checkpoint was trained on {state['train_samples']} training samples, this data gives "
                f"{len(self.train_set)} (other files, tokenizer, data.block_size, data.packing or data.val_fraction; "
                f"cache {state.get('cache')} then, {Path(self.cache.path).name} now): its data position does not "
                "apply; resume with the same data, or start fresh (ckpt_path=null).")
        if state["seed"] != self.seed:
            rank_zero_warn(f"data.seed={self.seed}, but the checkpoint's order was drawn with seed {state['seed']}: "
                           "the resumed run continues that order.")
            self.seed = state["seed"]
        self._resume = {"epoch": state["epoch"], "samples": state["samples"]}
