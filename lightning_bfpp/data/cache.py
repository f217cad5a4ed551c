"""The token cache: the documents' token ids in one memory-mapped file (uint16, or uint32 for vocabularies over
65,536) with a document index (where each document starts), prepared once per files x tokenizer x settings.

Preparation (``prepare_tokens``) tokenizes in parallel (``datasets.map``, with progress bars) into a hidden folder
``.<key>.tmp-*`` that takes the cache's name by one atomic rename once complete: an interrupted preparation leaves
only the hidden folder, never taken for a cache (the next preparation removes it). A lock file serializes two
processes preparing the same cache: the second waits, then reuses it. Opening (``TokenCache.open``) checks the sizes
and the index, and with ``checksums`` every file's sha256: a corrupted cache is an error naming the folder."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .encode import encode_batch, load_tokenizer, tokenizer_key
from .settings import DataError, TextSettings
from .sources import load_records, source_key

log = logging.getLogger(__name__)
VERSION = 1
TOKENS, DOCUMENTS, TRAINED, META = "tokens.bin", "documents.npy", "trained.bin", "meta.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class TokenCache:
    """A prepared cache: `tokens` (memory-mapped ids of every document, one after another), `offsets` (document d is
    tokens[offsets[d]:offsets[d + 1]]), `trained` (1 where the token is a target the loss counts; None: all are)."""

    path: Path
    meta: dict[str, Any]
    tokens: np.ndarray
    offsets: np.ndarray
    trained: np.ndarray | None

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def document_source(self, document: int) -> tuple[str, int]:
        """(file or dataset, record index in it) of a document."""
        for name, count in self.meta["sources"]:
            if document < count:
                return name, document
            document -= count
        raise IndexError(document)

    @classmethod
    def open(cls, path: Path, checksums: bool = False) -> TokenCache:
        """The cache in `path`, checked (sizes, index, and with `checksums` every file's sha256); a DataError naming
        the folder when it is corrupted."""
        path = Path(path)

        def corrupted(what: str) -> DataError:
            return DataError(f"the token cache {path} is corrupted ({what}): remove it (rm -r {path}) and run again; "
                             "it is prepared anew.")

        try:
            meta = json.loads((path / META).read_text())
            dtype, n_tokens, n_docs = np.dtype(meta["dtype"]), int(meta["num_tokens"]), int(meta["num_documents"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise corrupted(f"{META} unreadable: {err}") from None
        if meta.get("version") != VERSION:
            raise corrupted(f"format version {meta.get('version')}, not {VERSION}")
        files = [TOKENS, DOCUMENTS] + ([TRAINED] if meta.get("trained") else [])
        for name in files:
            if not (path / name).is_file():
                raise corrupted(f"{name} is missing")
        if (path / TOKENS).stat().st_size != n_tokens * dtype.itemsize:
            raise corrupted(f"{TOKENS} holds {(path / TOKENS).stat().st_size} bytes, not {n_tokens} tokens of "
                            f"{dtype.itemsize} bytes")
        if meta.get("trained") and (path / TRAINED).stat().st_size != n_tokens:
            raise corrupted(f"{TRAINED} holds {(path / TRAINED).stat().st_size} bytes, not {n_tokens}")
        try:
            offsets = np.load(path / DOCUMENTS, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise corrupted(f"{DOCUMENTS} unreadable: {err}") from None
        if offsets.shape != (n_docs + 1,) or offsets[0] != 0 or offsets[-1] != n_tokens or \
                bool((np.diff(offsets) < 0).any()):
            raise corrupted(f"{DOCUMENTS} is not an index of {n_docs} documents over {n_tokens} tokens")
        if checksums:
            for name in files:
                if sha256(path / name) != meta["sha256"].get(name):
                    raise corrupted(f"{name} does not match its sha256 in {META}")
        tokens = np.memmap(path / TOKENS, dtype=dtype, mode="r", shape=(n_tokens,)) if n_tokens else np.zeros(0, dtype)
        trained = np.memmap(path / TRAINED, dtype=np.uint8, mode="r", shape=(n_tokens,)) if meta.get("trained") \
            else None
        return cls(path, meta, tokens, np.asarray(offsets), trained)


def cache_key(settings: TextSettings, tokenizer: Any) -> str:
    parts = {"version": VERSION, "source": source_key(settings), "tokenizer": tokenizer_key(tokenizer),
             "format": settings.format, "text_field": settings.text_field, "sample_by": settings.sample_by,
             "append_eos": settings.append_eos}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def prepare_tokens(settings: TextSettings, checksums: bool = True, tokenizer: Any = None) -> TokenCache:
    """The token cache of `settings`: reused when complete, else prepared (one process at a time per cache; the
    others wait for it). `checksums`: verify a reused cache's files (sha256) before trusting it."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.tokenizer)
    root = settings.cache_dir
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(settings, tokenizer)
    final = root / key
    if final.exists():
        return _reuse(final, checksums)
    from filelock import FileLock, Timeout

    lock = FileLock(str(root / f".{key}.lock"))
    try:
        lock.acquire(timeout=2)
    except Timeout:
        log.info(f"data: another process is preparing {final}; waiting for it")
        lock.acquire()
    try:
        if not final.exists():  # (another process may have made it while this one waited)
            for stale in root.glob(f".{key}.tmp-*"):  # interrupted preparations: never a cache
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            write_cache(tmp, settings, tokenizer)
            os.rename(tmp, final)  # atomic: the cache exists complete or not at all
            return TokenCache.open(final)
    finally:
        lock.release()
    return _reuse(final, checksums)


def _reuse(path: Path, checksums: bool) -> TokenCache:
    """The complete cache in `path`, said once per launch (where it is checked with `checksums`)."""
    cache = TokenCache.open(path, checksums)
    log.log(logging.INFO if checksums else logging.DEBUG,
            f"data: reusing the token cache {path} ({cache.num_tokens} tokens, {cache.num_documents} documents)")
    return cache


def tokenization_processes(settings: TextSettings, records: int) -> int:
    """data.num_proc, else one process per core for large data (at least 2,000 records each), else 1."""
    if settings.num_proc is not None:
        return settings.num_proc
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                      records // 2000))


def write_cache(folder: Path, settings: TextSettings, tokenizer: Any) -> dict[str, Any]:
    """Tokenize the records of `settings` into `folder` (tokens, document index, trained mask, meta.json last)."""
    from tqdm.auto import tqdm

    started = time.perf_counter()
    records, fmt, sources = load_records(settings)
    processes = tokenization_processes(settings, len(records))
    if processes > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the processes are the parallelism
    log.info(f"data: tokenizing {len(records)} {fmt} records with {processes} process(es) into {folder.parent}")
    mapped = records.map(encode_batch, batched=True, with_indices=True, num_proc=processes,
                         remove_columns=records.column_names, desc="tokenizing", load_from_cache_file=False,
                         fn_kwargs={"tokenizer": tokenizer, "fmt": fmt, "text_field": settings.text_field,
                                    "append_eos": settings.append_eos})
    import pyarrow.compute as pc

    ids, trained = mapped.data.column("input_ids"), mapped.data.column("trained")
    lengths = np.concatenate([pc.list_value_length(c).to_numpy(zero_copy_only=False) for c in ids.chunks])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n_tokens = int(offsets[-1])
    if n_tokens == 0:
        raise DataError(f"data: the records of {', '.join(n for n, _ in sources)} hold no tokens.")
    vocab = len(tokenizer)
    dtype = token_dtype(vocab)
    keep_trained = fmt != "text"
    tokens = np.memmap(folder / TOKENS, dtype=dtype, mode="w+", shape=(n_tokens,))
    mask = np.memmap(folder / TRAINED, dtype=np.uint8, mode="w+", shape=(n_tokens,)) if keep_trained else None
    pos = 0
    with tqdm(total=n_tokens, unit="tok", unit_scale=True, desc="writing tokens") as bar:
        for id_chunk, trained_chunk in zip(ids.chunks, trained.chunks):
            flat = id_chunk.flatten().to_numpy(zero_copy_only=False)
            tokens[pos:pos + len(flat)] = flat
            if mask is not None:
                mask[pos:pos + len(flat)] = trained_chunk.flatten().to_numpy(zero_copy_only=False)
            pos += len(flat)
            bar.update(len(flat))
    tokens.flush()
    del tokens
    if mask is not None:
        mask.flush()
        del mask
    np.save(folder / DOCUMENTS, offsets)
    files = [TOKENS, DOCUMENTS] + ([TRAINED] if keep_trained else [])
    seconds = time.perf_counter() - started
    meta = {"version": VERSION, "dtype": dtype.name, "num_tokens": n_tokens, "num_documents": len(lengths),
            "vocab_size": vocab, "eos_id": tokenizer.eos_token_id,
            "pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0,
            "format": fmt, "trained": keep_trained, "sources": sources, "tokenizer": settings.tokenizer,
            "settings": {"format": settings.format, "text_field": settings.text_field,
                         "sample_by": settings.sample_by, "append_eos": settings.append_eos},
            "processes": processes, "seconds": round(seconds, 3), "tokens_per_s": round(n_tokens / seconds),
            "sha256": {name: sha256(folder / name) for name in files}}
    (folder / META).write_text(json.dumps(meta, indent=1))
    log.info(f"data: {n_tokens} tokens in {len(lengths)} documents, {n_tokens / seconds:,.0f} tokens/s")
    return meta
