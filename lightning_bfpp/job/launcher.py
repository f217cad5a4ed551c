"""Launching as bfpp uses it. Lightning's popen launcher, with the model checked before any other process
starts; the launching process observes and stops its children so the job ends with one exit code; SLURM's
requeue command for the requeue signal."""
from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from typing_extensions import override

from .._private.lightning_api import SubprocessScriptLauncher
from .ending import FAILED, say_stop
from .threads import apply_thread_rule

LAUNCHER_PID = "BFPP_LAUNCHER_PID"  # set by the launching process for the child ranks it starts
_LAUNCHED_BY = os.environ.pop(LAUNCHER_PID, "")  # in such a child: its launcher's pid (read once, not passed on)
# seconds the launching process gives its watchdog (1 s poll + 5 s grace + 1 s) after a child's failure
OBSERVER_WAIT = 9.0


class CheckingLauncher(SubprocessScriptLauncher):
    """Lightning's launcher (this process is rank 0 and starts ranks 1..), running `check` first: a model that
    cannot be cut into the requested stages fails once, here, before any other process or process group exists.

    Lightning's own child observer is replaced by ``ChildObserver``: Lightning's SIGKILLs the launching process
    5 s after a child's failure (exit 137, racing the watchdog's exit code); this one waits for the watchdog."""

    def __init__(self, check: Callable[[str | None, Any], None], *args: Any) -> None:
        super().__init__(*args)
        self._check = check

    @override
    def launch(self, function, *args: Any, trainer=None, **kwargs: Any) -> Any:
        self._check(ckpt_path_of(function, args, kwargs), trainer)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_PID] = str(os.getpid())  # the children's copy: who to watch while they join
            try:
                self._call_children_scripts()
            finally:
                os.environ.pop(LAUNCHER_PID, None)  # nothing else this process starts inherits it
            first = self.cluster_environment.node_rank() * self.num_processes + 1
            ChildObserver(self.procs, first, OBSERVER_WAIT, self.stop_children).start()
        apply_thread_rule(self.num_processes)
        return function(*args, **kwargs)

    @override
    def kill(self, signum) -> None:
        """Only SIGKILL is passed on. Lightning's SIGTERM handler forwards SIGTERM to the children; under bfpp
        the watchdog tells them through the job's store instead, so every rank names the rank that got it."""
        if signum == signal.SIGKILL:
            super().kill(signum)

    def stop_children(self, wait: float = 0.0) -> None:
        """SIGKILL the child ranks still running after `wait` seconds (none are left behind)."""
        deadline = time.monotonic() + wait
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        super().kill(signal.SIGKILL)


class ChildObserver(threading.Thread):
    """Ends the launching process when a child rank exits non-zero and the launching process is still alive
    `wait` seconds later (e.g. a child failed before the job's watchdog started): the other children are killed
    and this process exits with the job's code (the child's 128 + N after a stop signal, else 1)."""

    def __init__(self, procs: list[subprocess.Popen], first_rank: int, wait: float,
                 stop_children: Callable[[float], None], poll: float = 0.5) -> None:
        super().__init__(daemon=True, name="bfpp-child-observer")
        self.procs, self.first_rank, self.wait = procs, first_rank, wait
        self.stop_children, self.poll = stop_children, poll

    @override
    def run(self) -> None:
        while True:
            time.sleep(self.poll)
            codes = [p.poll() for p in self.procs]
            if all(c == 0 for c in codes):
                return
            failed = next(((i, c) for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                break
        time.sleep(self.wait)  # the watchdog or the main thread normally ends this process meanwhile
        i, code = failed
        say_stop(self.first_rank - 1, f"rank {self.first_rank + i} (pid {self.procs[i].pid}) exited with code {code}")
        self.stop_children(0.0)
        os._exit(code if code > 128 else FAILED)


@contextmanager
def launcher_watched(rank: Callable[[], int], poll: float = 0.5) -> Iterator[None]:
    """In a child rank of Lightning's launcher: while the job's processes join (before the watchdog, which notices a
    lost store, starts), end this rank when the launching process is gone (e.g. SIGKILLed, out of memory) instead
    of waiting out the rendezvous' timeout for a store that will never come. Elsewhere: nothing."""
    if not _LAUNCHED_BY:
        yield
        return
    launcher, joined = int(_LAUNCHED_BY), threading.Event()

    def watch() -> None:
        while True:
            if os.getppid() != launcher:  # re-parented: the launching process died
                say_stop(rank(), f"the launching process (rank 0, pid {launcher}) is gone before every rank joined "
                               "the job")
                os._exit(FAILED)
            if joined.wait(poll):
                return

    thread = threading.Thread(target=watch, daemon=True, name="bfpp-launcher-watch")
    thread.start()
    try:
        yield
    finally:
        joined.set()
        thread.join()


def ckpt_path_of(function: Callable, args: tuple, kwargs: dict) -> str | None:
    """The `ckpt_path` argument of a Trainer entry point (`_fit_impl`, `_validate_impl`, ...), if it has one."""
    try:
        return inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):
        return None


def slurm_requeue_signal(environment: ClusterEnvironment) -> int | None:
    """SLURM's requeue signal (SIGUSR1 by default) when Lightning's auto-requeue is on, else None."""
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
        return int(environment.requeue_signal)
    return None


def requeue_slurm_job() -> None:
    """`scontrol requeue <job>` (Lightning's convention for its SLURM auto-requeue; array jobs included)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        print(f"bfpp: not requeued: SLURM job id {job!r} is not a job id", file=sys.stderr, flush=True)
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job], timeout=30).returncode
    except (OSError, subprocess.TimeoutExpired) as error:
        result = error
    print(f"bfpp: SLURM job {job} " + ("requeued" if result == 0 else f"not requeued: scontrol requeue gave {result}"),
          file=sys.stderr, flush=True)
