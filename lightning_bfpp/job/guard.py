"""This rank's part in ending the job together (the strategy calls it from its Lightning hooks): the
watchdog starts with the process group, an exception is reported to every rank, a stop signal ends the
process with the job's exit code, and Lightning's launching process takes its child ranks down with it."""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from .._private.lightning_api import process_group_timeout_at_least
from .._private.torch_api import set_default_group_timeout
from .ending import FAILED, say_stop
from .launcher import CheckingLauncher, launcher_watched, requeue_slurm_job, slurm_requeue_signal
from .preempt import Preempted, default_grace_s
from .signals import STOP_SIGNALS
from .threads import threads_line
from .watchdog import Watchdog

STARTUP_TIMEOUT = timedelta(minutes=5)  # the least the rendezvous waits for every process to start
CHILDREN_WAIT_S = 15.0  # after a save on a signal, the launching process waits this long for its children to end


def rendezvous(strategy, setup_distributed: Callable[[], None]) -> None:
    """`setup_distributed()` (Lightning's process-group set-up) waiting at least STARTUP_TIMEOUT for every process
    to start (imports, a slow file system, a loaded machine), unless Lightning's launching process dies meanwhile;
    afterwards every wait is bounded by the strategy's `timeout` again. Then every rank has Lightning's CPU thread
    rule (``threads``), and global rank 0 says the number."""
    from torch.distributed import DistNetworkError

    try:
        with launcher_watched(lambda: strategy.global_rank), \
                process_group_timeout_at_least(strategy, STARTUP_TIMEOUT) as requested:
            setup_distributed()
    except DistNetworkError as error:
        if "EADDRINUSE" not in str(error):
            raise
        port = os.environ.get("MASTER_PORT")
        raise RuntimeError(f"The job's rendezvous port (MASTER_PORT={port}) is taken by another process (another job "
                           "on this machine?): give each job its own free MASTER_PORT, or leave it unset for Lightning "
                           f"to pick one. ({error})") from error
    if requested is not None and requested < STARTUP_TIMEOUT:
        set_default_group_timeout(requested)
    rank_zero_info(threads_line(strategy.num_processes))  # cores / local processes, as Lightning's launcher does


def as_timeout(timeout: timedelta | float | None) -> timedelta | None:
    """The strategy's `timeout` (a timedelta, or seconds) as a timedelta; a non-positive number is refused."""
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (default 1800).")
        return timedelta(seconds=timeout)
    return timeout


class JobGuard:
    """One per strategy; see ``lightning_bfpp.job.watchdog`` for how a failure or a signal reaches every rank."""

    def __init__(self) -> None:
        self.watchdog: Watchdog | None = None
        self.launcher = None  # Lightning's launcher when this process launched the others (set before the rendezvous)
        self.failed = False
        self.preempted: Preempted | None = None  # the run stopped after saving on a signal

    def start(self, global_rank: int, world_size: int, cluster_environment, on_signal: str = "exit",
              grace_s: float | None = None) -> None:
        """After the process group exists (a one-process job needs no watchdog unless it saves on a signal)."""
        save = on_signal == "save"
        if (world_size <= 1 and not save) or self.watchdog is not None:
            return
        requeue = slurm_requeue_signal(cluster_environment)
        self.watchdog = Watchdog(global_rank, world_size, on_exit=self.kill_children,
                                 signals=STOP_SIGNALS + ((requeue,) if requeue else ()),
                                 on_signal_stop=((lambda signum: requeue_slurm_job())
                                                 if requeue and global_rank == 0 else None),
                                 save_grace_s=((lambda signum: grace_s
                                                or default_grace_s(signum, cluster_environment, requeue))
                                               if save else None))
        self.watchdog.start()
        self.failed, self.preempted = False, None

    def save_requested(self, step: int) -> int | None:
        """The signal that asks every rank to save at `step` (on_signal="save"), else None."""
        return self.watchdog.save_requested(step) if self.watchdog is not None else None

    def saved_on_signal(self, signum: int, step: int, path) -> Preempted:
        """Say on this rank why the job stops (a launcher may kill this rank as soon as a peer exits, so it is said
        before any rank ends) and return the exception that ends the run."""
        rank, signalled = (self.watchdog.rank, self.watchdog.signalled_rank) if self.watchdog is not None else (0, 0)
        say_stop(rank, f"rank {signalled} got {signal.Signals(signum).name} (saved {path} at step {step})")
        return Preempted(signum, step, path)

    def progress(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.progress(step)

    def claim_signals(self) -> None:
        """Lightning installs its SIGTERM handler after ``setup_environment``; the watchdog's handlers go back on
        top at the start of every loop."""
        if self.watchdog is not None:
            self.watchdog.claim_signals()

    def kill_children(self, wait: float = 0.0) -> None:
        """When this rank is Lightning's launching process, its child ranks go down with it (after `wait`
        seconds in which they may stop by themselves and say why)."""
        if isinstance(self.launcher, CheckingLauncher):
            self.launcher.stop_children(wait)

    def on_exception(self, exception: BaseException) -> None:
        """Name the rank that failed first, on every rank. The launching process hosts the job's store: it
        outlives its children so they can read why the job stops."""
        if isinstance(exception, Preempted):  # every rank saved and stops here, together: not a failure
            self.preempted = exception
            return
        self.failed = True
        if self.watchdog is None:  # before the process group (its rendezvous timed out, a check refused the run)
            if getattr(exception, "job_wide", False):  # e.g. a checkpoint folder that cannot be written: said first
                say_stop(0, str(exception))  # only the launching process (global rank 0) runs before the group
            self.kill_children()
            return
        self.watchdog.report(exception)
        signalled = self.watchdog.code != FAILED
        self.kill_children(wait=self.watchdog.interval + (1.0 if signalled else self.watchdog.grace + 1.0))

    def stop(self) -> int | None:
        """Stop the watchdog; returns the exit code a stop signal gave the job (None: end normally)."""
        if self.watchdog is None:
            return None
        watchdog, self.watchdog = self.watchdog, None
        if self.preempted is not None:  # saved on the signal: every rank ends with its code
            watchdog.stop(finished=True)  # every rank said why in saved_on_signal
            signum = self.preempted.signum
            self.kill_children(wait=CHILDREN_WAIT_S)  # the launching process: its children stop by themselves
            if watchdog.on_signal_stop is not None:
                watchdog.on_signal_stop(signum)
            return 128 + signum
        code = watchdog.code if self.failed else None
        watchdog.stop(finished=not self.failed)
        return code if code != FAILED else None

    @staticmethod
    def exit(code: int) -> None:
        """End the process with the job's code (128 + N) rather than the code of a secondary error (a peer's
        closed connection), which would say 1 on some ranks."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
