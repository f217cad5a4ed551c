"""What a token cache is made from (``TextSettings``: files or a hub dataset, the record format, the tokenizer),
and the error every bad input raises (``DataError``: it names the file and the setting to change)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

FORMATS = ("auto", "text", "prompt_completion", "chat")  # what a record holds (encode.py)
PACKINGS = ("documents", "concat", "pad")  # how documents fill windows (packing.py)
SAMPLE_BY = ("document", "paragraph", "line")  # what one document of a .txt file is (datasets' text builder)
CACHE_ENV = "BFPP_DATA_CACHE"  # the default cache directory, else ~/.cache/lightning_bfpp/tokens


class DataError(ValueError):
    """Bad data input: a missing or empty file, a missing field, a document too long to pad, a tokenizer larger
    than the model, a corrupted cache. The message names the file, the setting and the fix."""


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lightning_bfpp" / "tokens")


@dataclass(frozen=True)
class TextSettings:
    """The inputs of one token cache (each part of its key but `num_proc` and `cache_dir`).

    files: local .txt, .jsonl/.json or .parquet files; else `dataset` (and `dataset_config`, `split`): a dataset name
    that Hugging Face ``datasets.load_dataset`` finds (the hub, where the network allows). format: what a record
    holds: ``text`` (the field `text_field`), ``prompt_completion`` (fields prompt and completion: prompt tokens are
    not trained), ``chat`` (field messages, rendered by the tokenizer's chat template: only the assistant's turns are
    trained), or ``auto`` (chat if there is a messages field, else prompt_completion if there are prompt and
    completion, else text). sample_by: what one document of a .txt file is. tokenizer: a directory (or hub name) that
    ``AutoTokenizer.from_pretrained`` reads. append_eos: end every document with the tokenizer's end-of-sequence
    token. num_proc: tokenization processes (None: one per core for large data). cache_dir: where caches live
    (default ``$BFPP_DATA_CACHE``, else ~/.cache/lightning_bfpp/tokens).
    """

    tokenizer: str
    files: tuple[str, ...] = ()
    dataset: str | None = None
    dataset_config: str | None = None
    split: str = "train"
    format: str = "auto"
    text_field: str = "text"
    sample_by: str = "document"
    append_eos: bool = True
    num_proc: int | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", tuple(str(f) for f in self.files or ()))
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        if self.format not in FORMATS:
            raise DataError(f"data.format={self.format!r} is not one of {', '.join(FORMATS)}.")
        if self.sample_by not in SAMPLE_BY:
            raise DataError(f"data.sample_by={self.sample_by!r} is not one of {', '.join(SAMPLE_BY)}.")
        if not self.files and not self.dataset:
            raise DataError("data=text needs its data: local files (data.files=[/abs/path/docs.jsonl, ...]: .txt, "
                            ".jsonl or .parquet) or a dataset name (data.dataset=NAME, read by Hugging Face datasets).")
        if self.files and self.dataset:
            raise DataError(f"data.files and data.dataset={self.dataset!r} are both set: give one of them.")
        if self.num_proc is not None and (not isinstance(self.num_proc, int) or self.num_proc < 1):
            raise DataError(f"data.num_proc={self.num_proc!r} must be a positive integer, or null (one per core).")
