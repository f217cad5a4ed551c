"""A checkpoint folder that fills up like a small disk, on any machine: torch.distributed.checkpoint's writes there
(through bfpp's CheckpointWriter, a FileSystemWriter subclass) raise OSError(ENOSPC) once the files under the folder
would pass `quota` bytes, after writing what still fits, as a full filesystem does; the free space bfpp reads there is
what is left of the quota. The files of every rank count (they share the folder, as ranks share a disk), and deleting
files frees their space. The real thing (a small tmpfs) is tested where the machine lets a test mount one."""
from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_bfpp.checkpoint import storage


def used_bytes(folder: Path) -> int:
    """Bytes of the files under `folder`; another rank may be deleting them meanwhile (a failed save's folder): os.walk
    passes over a folder gone while it lists it (Path.rglob raised FileNotFoundError there, a race seen under load)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


class _QuotaStream:
    """A file of the quota folder: each write goes to the file at once (so its size counts), or fails like ENOSPC."""

    def __init__(self, stream: Any, folder: Path, quota: int) -> None:
        self._stream, self._folder, self._quota = stream, folder, quota

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        room = self._quota - used_bytes(self._folder)
        if len(view) > room:
            if room > 0:
                self._stream.write(view[:room])
            self._stream.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = self._stream.write(view)
        self._stream.flush()
        return written


@contextlib.contextmanager
def limited(folder: Path, quota: int) -> Iterator[None]:
    """Within the block, `folder` holds at most `quota` bytes of checkpoint files (see the module's docstring)."""
    folder = Path(folder).absolute()
    real_free, real_filesystem = storage.free_bytes, storage.CheckpointWriter.filesystem

    class QuotaFileSystem(real_filesystem):
        def open_stream(self, path, mode):
            inner = super().open_stream(path, mode)
            if "w" not in mode or folder not in Path(path).absolute().parents:
                return inner
            return _wrapped(inner)

    @contextlib.contextmanager
    def _wrapped(inner: contextlib.AbstractContextManager) -> Iterator[_QuotaStream]:
        with inner as stream:
            yield _QuotaStream(stream, folder, quota)

    def free_bytes(path: Path) -> int | None:
        inside = Path(path).absolute() == folder or folder in Path(path).absolute().parents
        return max(0, quota - used_bytes(folder)) if inside else real_free(path)

    storage.free_bytes, storage.CheckpointWriter.filesystem = free_bytes, QuotaFileSystem
    try:
        yield
    finally:
        storage.free_bytes, storage.CheckpointWriter.filesystem = real_free, real_filesystem
