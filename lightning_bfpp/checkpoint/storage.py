"""The storage under the checkpoints: torch.distributed.checkpoint's file writer with its OS errors kept (torch's zip
writer reports a full disk as ``unexpected pos N vs M``), the free space, a save's size and the one-line report of a
failed save, the check that a checkpoint directory is writable before training starts, and the run's record of its
saves (``Storage``: the last save's size, the warning given once when the space left is below two saves)."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from .errors import StorageNames, unwritable_error

LOW_SPACE_SAVES = 2  # warn (once) when the free space is below this many saves of the last one's size
# torch's zip writer hides a full disk's OSError ("unexpected pos N vs M"): a failed save that leaves less than this
# free is taken for a full disk even when no OSError was kept
FULL_BELOW_BYTES = 1 << 20


@dataclass
class Storage:
    """One strategy's saves: how errors spell the settings (`names`; an app sets its own keys), the size of the last
    complete save, and whether the low-space warning was given."""

    names: StorageNames = field(default_factory=StorageNames)
    last_bytes: int | None = None
    warned: bool = False


def free_bytes(path: Path) -> int | None:
    """Bytes free for this user on the filesystem holding `path` (or its nearest existing parent)."""
    try:
        return shutil.disk_usage(existing_parent(path)).free
    except OSError:
        return None


def existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def state_bytes(state: Any, prefix: str = "") -> tuple[int, dict[str, int]]:
    """What this rank holds of `state`: (bytes of its shards of sharded tensors, {key: bytes} of whole tensors, which
    other ranks may hold too: ``save`` counts each key once)."""
    if isinstance(state, dict):
        parts = [state_bytes(v, f"{prefix}{k}.") for k, v in state.items()]
    elif isinstance(state, (list, tuple)):
        parts = [state_bytes(v, f"{prefix}{i}.") for i, v in enumerate(state)]
    elif isinstance(state, torch.Tensor):
        local = getattr(state, "to_local", None)
        if local is not None and not all(p.is_replicate() for p in state.placements):
            tensor = local()
            return tensor.numel() * tensor.element_size(), {}
        tensor = local() if local is not None else state
        return 0, {prefix: tensor.numel() * tensor.element_size()}
    else:
        return 0, {}
    return sum(p[0] for p in parts), {k: v for p in parts for k, v in p[1].items()}


def remove_quietly(folder: Path) -> None:
    """Delete a failed save's folder (other ranks may be deleting it at the same time)."""
    for _ in range(3):
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            return


def kept_os_error(error: BaseException) -> tuple[int | None, OSError] | None:
    """(rank, the OSError) behind a failed save or load: inside torch.distributed.checkpoint's gathered failures (the
    first rank's), or `error` itself and its causes; None when no OSError is behind it."""
    if isinstance(error, CheckpointException):
        for rank, (failure, _trace) in sorted(error.failures.items()):
            found = kept_os_error(failure)
            if found is not None:
                return rank, found[1]
        return None
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return None, error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class KeptErrorsFileSystem(FileSystem):
    """torch's FileSystem that keeps the first OSError a checkpoint file's write, flush or close raised, with the
    file's path (a write's OSError names no file; torch's zip writer replaces it with ``unexpected pos N vs M``)."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[OSError] = []

    def open_stream(self, path: str | os.PathLike, mode: str) -> contextlib.AbstractContextManager:
        """The file as the OS gives it."""
        return super().create_stream(path, mode)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        try:
            with self.open_stream(path, mode) as stream:
                yield _KeepingStream(stream, path, self) if "w" in mode else stream
        except OSError as e:
            self.keep(e, path)
            raise

    def keep(self, error: OSError, path: str | os.PathLike) -> None:
        if not self.errors:
            self.errors.append(error if error.filename else OSError(error.errno, error.strerror, str(path)))


class _KeepingStream:
    """A writable stream whose OSErrors its filesystem keeps (everything else is the stream's own)."""

    def __init__(self, stream: Any, path: str | os.PathLike, fs: KeptErrorsFileSystem) -> None:
        self._stream, self._path, self._fs = stream, path, fs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._stream, name)(*args)
        except OSError as e:
            self._fs.keep(e, self._path)
            raise

    def write(self, data: Any) -> Any:
        return self._call("write", data)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")


class CheckpointWriter(FileSystemWriter):
    """torch.distributed.checkpoint's FileSystemWriter whose failures are the OSError behind them, naming the file
    (so every rank learns the errno and the path from DCP's gathered failures)."""

    filesystem = KeptErrorsFileSystem  # how the files are opened (a test injects faults here)

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = self.filesystem()

    def write_data(self, plan: Any, planner: Any) -> Any:
        with self._raising_kept_error():
            return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        with self._raising_kept_error():
            super().finish(metadata, results)

    @contextlib.contextmanager
    def _raising_kept_error(self) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            if self.fs.errors and self.fs.errors[0] is not e:
                raise self.fs.errors[0] from e
            raise


def full_disk(free: int | None, path: Path) -> OSError | None:
    """A failed save with no OSError kept but (almost) no space left: the full disk torch's zip writer hid."""
    if free is not None and free < FULL_BELOW_BYTES:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None


def check_writable(directory: Path, setting: str) -> None:
    """Raise StorageError when this process cannot create files in `directory` (or, if it does not exist yet, in its
    nearest existing parent, where it would be made): tried, not guessed from permission bits."""
    target = existing_parent(directory)
    try:
        if not target.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(target))
        Path(tempfile.mkdtemp(prefix=".bfpp-write-check-", dir=target)).rmdir()
    except OSError as e:
        raise unwritable_error(Path(directory), target, e, setting) from None


def check_save_dirs(trainer: Any, signal_checkpoint: str | os.PathLike | None, names: StorageNames) -> None:
    """Before fitting: every folder this run will save checkpoints to is writable (its ModelCheckpoints' folders,
    the folder of a save on a stop signal), or StorageError names it and the setting."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint):
            given = callback.dirpath is not None
            folder = Path(callback.dirpath) if given else Path(trainer.default_root_dir)
            check_writable(folder, names.where("ModelCheckpoint(dirpath=...)" if given else
                                               "Trainer(default_root_dir=...)"))
    if signal_checkpoint is not None:
        check_writable(Path(signal_checkpoint).parent, names.where("BFPPStrategy(signal_checkpoint=...)"))
