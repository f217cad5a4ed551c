"""Stop signals handed to a watching thread: while a watchdog runs, this process's handler for SIGTERM, SIGINT (and
SLURM's requeue signal) does nothing in the main thread, which may be anywhere in a pipeline step; the signal's
number reaches the watching thread through ``signal.set_wakeup_fd``, even when the main thread is blocked in a
collective."""
from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable, Sequence

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Relay:
    """This process's handler for a stop signal while a watchdog runs. It does nothing in the main thread: the signal
    reaches the watching thread through the wakeup fd of `pipe`. Without a running watchdog it behaves like the
    handler it replaced."""

    def __init__(self, pipe: SignalPipe, previous) -> None:
        self.pipe = pipe
        self.previous = previous.previous if isinstance(previous, Relay) else previous

    def __call__(self, signum: int, frame) -> None:
        if self.pipe.watching():
            return
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous != signal.SIG_IGN:  # the default action (terminate)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


class SignalPipe:
    """`signals` delivered to a watching thread (``wait``) instead of the main thread, while `watching()` is true.

    Made in the main thread (Python runs handlers there only): it installs the wakeup fd and a ``Relay`` for each
    signal; ``restore`` (main thread) puts the previous ones back, ``close_read`` (the watching thread) ends it."""

    def __init__(self, signals: Sequence[int], watching: Callable[[], bool]) -> None:
        self.signals = tuple(signals)
        self.watching = watching
        self._read, self._write = os.pipe()
        for fd in (self._read, self._write):
            os.set_blocking(fd, False)
        self._old_wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._old_handlers = {s: signal.getsignal(s) for s in self.signals}
        self.claim()

    def claim(self) -> None:
        """(Re)install the relays, e.g. after Lightning installed its own SIGTERM handler (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            current = signal.getsignal(s)
            if not (isinstance(current, Relay) and current.pipe is self):
                signal.signal(s, Relay(self, current))

    def restore(self) -> None:
        """Put back the handlers and the wakeup fd found at the start, and close the write end (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s, handler in self._old_handlers.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self._write)  # the read end is closed by the watching thread

    def wait(self, timeout: float) -> int | None:
        """One of `signals` if it arrives within `timeout` seconds (else None)."""
        try:
            if select.select([self._read], [], [], timeout)[0]:
                for signum in os.read(self._read, 512):
                    if signum in self.signals:
                        return signum
        except (OSError, ValueError):  # the pipe was closed by restore()
            pass
        return None

    def close_read(self) -> None:
        """Close the read end (the watching thread, when it leaves its loop)."""
        os.close(self._read)
