"""Saves written while training goes on (strategy async_save=True). torch.distributed.checkpoint's async_save
copies the state to CPU memory in the calling thread, then writes the shards from a thread of its own; a thread
here then finishes the folder (meta.pt, manifest, rename: ``saving._finish``). Both threads' collectives run on a
process group of their own (gloo), so they never interleave with training's. One save at a time: the next save,
and the end of training, wait for the one under way."""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist


class BackgroundSaves:
    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._pending: Future | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def under_way(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the save under way is complete; raises its error, if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def start(self, write: Callable[[dist.ProcessGroup | None], Future],
              finish: Callable[[dist.ProcessGroup | None], None]) -> None:
        """`write(group)` (returns when the state is staged; its future when written), then `finish(group)` in the
        background. Collective: every rank starts the same saves in the same order."""
        self.wait()
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        upload = write(self._group)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="bfpp-save")
        group = self._group
        self._pending = self._executor.submit(lambda: (upload.result(), finish(group)))

    def close(self) -> None:
        """Wait for the save under way; stop the thread (its process group is destroyed with the others)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._executor, self._group = None, None
