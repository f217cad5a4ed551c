"""Saves written while training goes on (strategy async_save=True). torch.distributed.checkpoint's async_save
copies the state to CPU memory in the calling thread, then writes the shards from a thread of its own; a thread
here then finishes the folder (meta.pt, manifest, rename: ``saving._finish``). Both threads' collectives run on a
process group of their own (gloo), so they never interleave with training's. One save at a time: the next save,
and the end of training, wait for the one under way. A save that fails in the background removes its partial folder
there, and its error is raised at the next step boundary (``raise_failure``): the previous checkpoint stays the
newest complete one."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist


@contextlib.contextmanager
def raising_as_told(failed: Callable[[BaseException], BaseException]) -> Iterator[None]:
    """A save's failure (any exception: torch's CheckpointException is one) passed through `failed` (its clean-up),
    and what that returns raised instead, chained to it (the error itself when `failed` keeps it)."""
    try:
        yield
    except BaseException as error:
        told = failed(error)
        if told is error:
            raise
        raise told from error


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

    def raise_failure(self) -> None:
        """At a step boundary: raise the error of a save that failed in the background (once); a save still under way
        or complete passes."""
        if self._pending is not None and self._pending.done() and self._pending.exception() is not None:
            self.wait()

    def start(self, write: Callable[[dist.ProcessGroup | None], Future],
              finish: Callable[[dist.ProcessGroup | None], None],
              failed: Callable[[BaseException], BaseException] = lambda error: error) -> None:
        """`write(group)` (returns when the state is staged; its future when written), then `finish(group)` in the
        background; when either fails, `failed(error)` (the clean-up, in the background) gives the error to raise.
        Collective: every rank starts the same saves in the same order."""
        self.wait()
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        upload = write(self._group)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="bfpp-save")
        group = self._group

        def complete() -> None:
            with raising_as_told(failed):
                upload.result()
                finish(group)

        self._pending = self._executor.submit(complete)

    def close(self) -> None:
        """Wait for the save under way; stop the thread (its process group is destroyed with the others)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._executor, self._group = None, None
