"""A byte-level text corpus that needs no download — the Python standard library's own .py
files, read in sorted order and capped — plus the LightningDataModule the examples train on.
NOTE: the corpus is deterministic for one Python build; another Python version means other bytes."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_bfpp.dims import Names, ParallelDims
from lightning_bfpp.schedule import ScheduleSpec

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """All .py files under the stdlib directory (installed packages excluded), sorted by relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_bytes: int = 8_000_000, root: str | Path | None = None) -> bytes:
    """The first `max_bytes` bytes of the concatenated stdlib sources (files joined by a blank line)."""
    chunks, size = [], 0
    for path in stdlib_files(root):
        data = path.read_bytes() + b"\n\n"
        chunks.append(data[: max_bytes - size])
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    return b"".join(chunks)


def split_corpus(data: bytes, val_fraction: float) -> tuple[bytes, bytes]:
    """Deterministic split: the last `val_fraction` of the bytes is validation (files stay mostly whole)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(data) * (1.0 - val_fraction))
    return data[:cut], data[cut:]


class ByteWindows(Dataset):
    """(x, y) windows over a byte string: x = bytes[i*stride : i*stride+T], y = the same shifted by one."""

    def __init__(self, data: bytes, block_size: int, stride: int | None = None) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.block_size, self.stride = block_size, stride or block_size
        if len(self.data) < block_size + 1:
            raise ValueError(f"corpus of {len(self.data)} bytes is shorter than block_size + 1 = {block_size + 1}")

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def replica_batch_size(batch_size: int, data_parallel: int, micro_batches: int = 1) -> int:
    """The per-process DataLoader batch for a GLOBAL `batch_size`, checked by the layout's own rule to split
    over the data-parallel replicas and their micro-batches."""
    dims = ParallelDims(world=data_parallel, spec=ScheduleSpec(micro_batches=micro_batches))
    return dims.replica_batch(batch_size, Names(batch="data.batch_size", micro_batches="schedule.micro_batches"))


class CorpusDataModule(L.LightningDataModule):
    """Stdlib byte corpus. `batch_size` is the global batch per step; each data-parallel replica loads
    batch_size / data_parallel (pipeline ranks of one replica load the same samples)."""

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        max_bytes: int = 8_000_000,
        val_fraction: float = 0.05,
        stride: int | None = None,
        seed: int = 1234,
        num_workers: int = 0,
        data_parallel: int | None = None,
        micro_batches: int | None = None,
    ) -> None:
        super().__init__()
        self.block_size, self.batch_size, self.max_bytes = block_size, batch_size, max_bytes
        self.val_fraction, self.stride, self.seed, self.num_workers = val_fraction, stride, seed, num_workers
        self.data_parallel, self.micro_batches = data_parallel, micro_batches
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    def _layout(self) -> tuple[int, int]:
        """(data_parallel, micro_batches): given explicitly, else read from the trainer's strategy."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        dp = self.data_parallel or getattr(strategy, "data_parallel", None) or getattr(strategy, "world_size", 1)
        mb = self.micro_batches or getattr(strategy, "micro_batches", None) or 1
        return int(dp), int(mb)

    @property
    def per_replica_batch_size(self) -> int:
        return replica_batch_size(self.batch_size, *self._layout())

    def setup(self, stage: str | None = None) -> None:
        _ = self.per_replica_batch_size  # fail early, naming the settings
        if self.train_set is None:
            train, val = split_corpus(load_corpus(self.max_bytes), self.val_fraction)
            self.train_set = ByteWindows(train, self.block_size, self.stride)
            self.val_set = ByteWindows(val, self.block_size, self.block_size)

    def train_dataloader(self) -> DataLoader:
        """Shuffled by the sampler Lightning would give a distributed run (DistributedSampler, seed `seed`,
        reshuffled every epoch), here also in one process: strategy="auto" on one device draws the very batches
        of bfpp at data_parallel=1, so the two runs are comparable step by step."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        replicas = getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(self.train_set, shuffle=True, seed=self.seed, **replicas)
        return DataLoader(self.train_set, batch_size=self.per_replica_batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.per_replica_batch_size, shuffle=False, drop_last=True,
                          num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


# ---- data=text (conf/data/text.yaml): lightning_bfpp.data, prepared before any process starts ----
TEXT_SETTINGS = ("files", "dataset", "dataset_config", "split", "format", "text_field", "sample_by", "append_eos",
                 "num_proc")


def text_settings(cfg):
    """lightning_bfpp.data.TextSettings of `data.*`; the tokenizer is data.tokenizer, else model.path's own."""
    from app.checks import ConfigError
    from omegaconf import OmegaConf

    from lightning_bfpp.data import DataError, TextSettings

    d = OmegaConf.to_container(cfg.data, resolve=True)
    tokenizer = d.get("tokenizer") or (cfg.model.path if cfg.model.get("family") == "hf_pretrained" else None)
    if not tokenizer:
        raise ConfigError(f"data=text needs a tokenizer: data.tokenizer=/abs/path/to/tokenizer (a save_pretrained "
                          f"directory), or model=hf_pretrained model.path=DIR, whose own tokenizer is used "
                          f"(model={cfg.model.name} has none).")
    try:
        return TextSettings(tokenizer=str(tokenizer), cache_dir=d.get("cache_dir") or default_cache_dir(),
                            **{k: d[k] for k in TEXT_SETTINGS if k in d})
    except DataError as err:
        raise ConfigError(str(err)) from None


def default_cache_dir():
    from lightning_bfpp.data.settings import default_cache_dir

    return default_cache_dir()


def prepare_text(cfg, checksums: bool = True) -> None:
    """Before any process starts: the token cache of data=text, prepared or reused (sha256-checked with `checksums`),
    and what would fail later checked now: a tokenizer larger than the model's vocabulary, a document too long for
    data.packing=pad, fewer windows than one batch (training; validation when it runs). ConfigError naming the fix."""
    from app.checks import ConfigError

    from lightning_bfpp.data import DataError, prepare_tokens
    from lightning_bfpp.data.encode import load_tokenizer
    from lightning_bfpp.data.packing import document_split, packed

    settings = text_settings(cfg)
    d, vocab = cfg.data, cfg.model.vocab_size
    setting = "data.tokenizer" if cfg.data.get("tokenizer") else "model.path"
    try:
        tokenizer = load_tokenizer(settings.tokenizer, setting)
        if len(tokenizer) > vocab:
            raise ConfigError(
                f"the tokenizer of {setting}={settings.tokenizer} has {len(tokenizer)} tokens, more than the model's "
                f"model.vocab_size={vocab}: its ids would index past the embedding. Use the model's own tokenizer, or "
                f"a model with model.vocab_size >= {len(tokenizer)}.")
        cache = prepare_tokens(settings, checksums=checksums, tokenizer=tokenizer)
        splits = [packed(cache, docs, d.block_size, d.packing) for docs in document_split(cache, d.val_fraction)]
    except DataError as err:
        raise ConfigError(str(err)) from None
    validates = cfg.trainer.get("limit_val_batches") not in (0, 0.0)
    for rows, split in zip(splits, ("training", "validation")):
        if len(rows) < d.batch_size and (split == "training" or validates):
            raise ConfigError(
                f"data=text: the {split} split holds {len(rows)} rows of data.block_size={d.block_size} tokens "
                f"(data.packing={d.packing}, {cache.num_tokens} tokens in {cache.num_documents} documents, "
                f"data.val_fraction={d.val_fraction}), fewer than one batch of data.batch_size={d.batch_size}; give "
                "more data, a smaller data.batch_size" + (", or trainer.limit_val_batches=0" if split == "validation"
                                                           else "") + ".")


def build_datamodule(cfg) -> L.LightningDataModule:
    """The data module of `data.name`: local_corpus (CorpusDataModule) or text (lightning_bfpp.data.TextDataModule)."""
    from omegaconf import OmegaConf

    d = OmegaConf.to_container(cfg.data, resolve=True)
    if d["name"] != "text":
        return CorpusDataModule(**{k: v for k, v in d.items() if k != "name"})
    from lightning_bfpp.data import TextDataModule

    return TextDataModule(text_settings(cfg), block_size=d["block_size"], batch_size=d["batch_size"],
                          packing=d["packing"], val_fraction=d["val_fraction"], seed=d["seed"],
                          num_workers=d["num_workers"])
