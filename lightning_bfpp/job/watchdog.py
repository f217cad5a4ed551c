"""Failure handling across ranks. One daemon thread per rank notices a peer that reported a
failure, died (killed, out of memory) or got a stop signal (SIGTERM, SIGINT, SLURM's requeue signal) and
takes this rank down with a message naming that peer and, for signals, the signal. Every rank ends with the
job's exit code, so no rank waits in a collective until the timeout and no process is left behind.

The watch loop and its agreements live here; what the ranks post to the job's store is ``posts``, how a signal
reaches the watching thread ``signals``, whether a local peer is alive ``liveness``, the exit codes and the line
that says why ``ending``."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from .._private.torch_api import default_store
from .ending import FAILED, say, say_stop, signal_code
from .liveness import dead_peer
from .posts import Posts
from .signals import STOP_SIGNALS, SignalPipe


def _is_communication_error(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, dist.DistError) or any(k in text for k in ("gloo", "NCCL", "Connection", "connection"))


class Watchdog:
    """Watches the other ranks of this job through the process group's key-value store.

    - A rank whose run raises posts ``rank R failed: <error>`` (the first post wins); every other rank prints
      it and exits within ``interval + grace`` seconds, even if blocked in a collective.
    - A rank that gets one of `signals` posts ``rank R got SIGTERM``; every rank prints it and exits at once
      with ``signal_code`` (the launching process first waits up to ``interval + 1`` s for its children).
      With `save_grace_s` (on_signal="save"), a signal during training instead asks every rank to save at an
      agreed step (``save_requested``); the job exits when saved, or after ``save_grace_s(signal)`` seconds
      without it, or at a second signal to the same process.
    - A peer process on this host that is gone without having finished is reported as killed/crashed.
    - A lost store (it lives in rank 0 or the launcher) ends this rank after ``grace`` seconds unless
      the run finishes meanwhile (rank 0 may simply have finished first).
    Peers on other hosts are watched through posted failures only; a silent death there ends the
    collectives by their timeout (and torchrun/srun stop the job).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        interval: float = 1.0,
        grace: float = 5.0,
        on_exit: Callable[[float], None] | None = None,
        signals: Sequence[int] = STOP_SIGNALS,
        on_signal_stop: Callable[[int], None] | None = None,
        save_grace_s: Callable[[int], float] | None = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.interval, self.grace = interval, grace
        self.on_exit = on_exit  # called with seconds to give child processes before they are killed
        self.signals = tuple(int(s) for s in signals)
        self.on_signal_stop = on_signal_stop  # called with the signal before this process exits (SLURM requeue)
        # on_signal="save": seconds a save may take after signal N (None: a signal ends the job at once)
        self.save_grace_s = save_grace_s
        self._own_signals = 0  # signals this process got: a second one ends the job at once, saved or not
        self._save_deadline: float | None = None  # once a save was asked for: when the job exits without it
        self._save_request: tuple[int, int, int] | None = None  # (signal, rank that got it, step to save at)
        self.signalled_rank: int | None = None  # the rank whose signal asked for the save (``save_requested``)
        self.code: int | None = None  # the job's exit code once a stop is known
        self._signal_pipe: SignalPipe | None = None  # this process's signals, handed to the watching thread
        self._store = default_store()
        self.posts = Posts(self._store, rank)  # one key space per run (fit, validate, ...) of this job's store
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers: dict[int, int] = {}  # rank -> pid, for peers on this host
        self._step: int | None = None  # the training step this rank has reached (`progress`)
        self._published_step: int | None = None  # the last one written to the store
        self._said: str | None = None  # the job-wide failure this rank raised and reported itself (``report``)

    # ---- lifecycle (main thread) ---------------------------------------------------------------------
    def start(self) -> None:
        """Publish this process, learn which peers share this host (waits for every rank), start watching."""
        self._peers = self.posts.local_peers(self._store, self.rank, self.world_size)
        if threading.current_thread() is threading.main_thread():
            self._signal_pipe = SignalPipe(self.signals, lambda: self.watching)
        self._thread = threading.Thread(target=self._watch, args=(self._store.clone(),), daemon=True,
                                        name="bfpp-watchdog")
        self._thread.start()

    @property
    def watching(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def claim_signals(self) -> None:
        """(Re)install this watchdog's handlers for its signals, e.g. after Lightning installed its own SIGTERM
        handler (which broadcasts from inside the handler, so ranks meet in collectives that never match)."""
        if self._signal_pipe is not None:
            self._signal_pipe.claim()

    def stop(self, finished: bool) -> None:
        """Stop watching; `finished` marks a normal end, so peers do not take this rank's exit for a crash."""
        self._stop.set()
        if self._signal_pipe is not None:
            self._signal_pipe.restore()
        if finished:
            try:
                self.posts.set_finished(self._store, self.rank)
            except Exception:  # the store's host may already be gone at the very end; nothing waits on this
                pass
        self._join()

    def _join(self) -> None:
        """Wait for the watching thread to leave its loop. A daemon thread that returns from a store call while
        the interpreter shuts down is ended by a forced unwind, which C++ turns into `terminate called without an
        active exception` (SIGABRT): a job that trained would exit as failed."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout=self.interval + self.grace)
        if thread.is_alive():
            say(self.rank, f"the watchdog thread did not stop within {self.interval + self.grace:.0f} s (a store "
                           "call still running); the process may abort at exit")

    def report(self, error: BaseException) -> str:
        """Say (and post, unless a peer failed first) why the job stops; returns that message. A communication
        error is usually a peer's failure seen from here: look for that peer for up to `grace` seconds."""
        summary = " ".join([str(error).splitlines()[0] if str(error) else "", *getattr(error, "__notes__", [])])
        deadline = time.monotonic() + (self.grace if _is_communication_error(error) else 0.0)
        while True:
            posted = self._posted()
            culprit = posted[1] if posted else self._dead_peer(self._store, store_errors=False)
            if culprit or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if not posted and not culprit:
            try:
                self._publish_step(self._store)  # this rank's own step is current before comparing
            except Exception:
                pass
        code, culprit = posted or (FAILED, culprit or self._reason(error, summary))
        try:
            code, culprit = self.posts.post_stop(self._store, code, culprit)
        except Exception:  # the store's host is gone: say what this rank knows
            pass
        self.code = code
        if getattr(error, "job_wide", False):
            self._said = culprit  # every rank raised it: this rank's own ending, as for its own failure
        return say_stop(self.rank, culprit)

    def _reason(self, error: BaseException, summary: str) -> str:
        """Why the job stops when this rank raised `error`. An error every rank raised alike (``job_wide``: a failed
        save or load, its cause shared by every rank) is told as it is, blaming no rank. Only a failed wait (a timeout,
        a closed connection) names the ranks behind the others: there, one that stopped stepping explains it."""
        if getattr(error, "job_wide", False):
            return summary
        behind = self._laggards() if _is_communication_error(error) else ""
        return f"rank {self.rank} failed: {type(error).__name__}: {summary}{behind}"

    def progress(self, step: int) -> None:
        """Note the training step this rank has reached (named when a wait times out on a stuck rank). Only noted
        here: the watching thread writes it to the store (within `interval` seconds), off the training step."""
        self._step = step

    def save_requested(self, step: int) -> int | None:
        """The signal that asked for a save at `step` (an optimizer step boundary every rank checks), else None.

        The rank that got the signal asks for a save at its step + 2: every other rank is at most one step ahead of
        it (each step's collectives need all ranks), so each reads the request here at that step, and all save there.
        One process has no peer to agree with: it reads the request its own watching thread posted (no store round
        trip on every training step)."""
        if self.save_grace_s is None:
            return None
        try:
            request = self._save_request if self.world_size == 1 else self.posts.posted_save(self._store)
        except Exception:  # the store is gone: the watching thread ends this rank
            return None
        if request is None:
            return None
        signum, rank, target = request
        if step < target:
            return None
        self.code, self.signalled_rank = signal_code(signum), rank
        return signum

    def _publish_step(self, store) -> None:
        step = self._step
        if step is not None and step != self._published_step:
            self.posts.set_step(store, self.rank, step)
            self._published_step = step

    def _laggards(self) -> str:
        """'; rank 3 did not reach step N ...' when some ranks are behind the step the others are in."""
        try:
            steps = self.posts.steps(self._store, self.world_size)
        except Exception:
            return ""
        if steps is None:
            return ""
        behind = [r for r, step in enumerate(steps) if step < max(steps)]
        if not behind:
            return ""
        who = ", ".join(map(str, behind))
        return (f"; rank{'s' if len(behind) > 1 else ''} {who} did not reach step {max(steps)} like the others "
                f"(stuck or much slower)")

    def _posted(self) -> tuple[int, str] | None:
        try:
            return self.posts.posted_stop(self._store)
        except Exception:
            return None

    # ---- the watching thread -------------------------------------------------------------------------
    def _watch(self, store) -> None:
        try:
            self._watch_until_stop(store)
        finally:
            if self._signal_pipe is not None:
                self._signal_pipe.close_read()

    def _watch_until_stop(self, store) -> None:
        while True:
            signum = self._wait_for_signal(self.interval)
            if self._stop.is_set():
                return
            if signum is not None:
                self._own_signals += 1
                if self._own_signals == 1 and self._ask_for_save(store, signum):
                    continue
                code, reason = signal_code(signum), f"rank {self.rank} got {signal.Signals(signum).name}"
                try:
                    code, reason = self.posts.post_stop(store, code, reason)
                except Exception:  # the store's host is gone: say what this rank knows
                    pass
                self._exit(code, reason)
                return
            try:
                self._publish_step(store)
                self._save_under_way(store)
                posted = self.posts.posted_stop(store)
                if posted is not None:
                    code, reason = posted
                    if code != FAILED or not (reason.startswith(f"rank {self.rank} ") or reason == self._said):
                        self._exit(code, reason)
                        return
                dead = self._dead_peer(store)
            except Exception:
                if not self._stop.wait(self.grace):
                    self._exit(FAILED, "the job's key-value store is gone: rank 0 (or the launcher) stopped", wait=0.0)
                return
            if dead is not None:
                code = FAILED
                try:
                    code, dead = self.posts.post_stop(store, code, dead)
                except Exception:
                    pass
                self._exit(code, dead)
                return

    def _ask_for_save(self, store, signum: int) -> bool:
        """On this rank's first signal in save mode, while training: post a save at this rank's step + 2 (the first
        post wins: SLURM signals every rank). False when the job should stop at once instead."""
        if self.save_grace_s is None or self._step is None:
            return False
        try:
            self._save_under_way(store, self.posts.post_save(store, signum, self.rank, self._step + 2))
        except Exception:  # the store's host is gone
            return False
        return True

    def _save_under_way(self, store, request: tuple[int, int, int] | None = None) -> None:
        """Once a save is asked for (by any rank): say so, and end this rank when it takes longer than its grace."""
        if self.save_grace_s is None:
            return
        if self._save_deadline is None:
            if request is None:
                request = self.posts.posted_save(store)
                if request is None:
                    return
            signum, rank, target = request
            grace = self.save_grace_s(signum)
            self._save_deadline = time.monotonic() + grace
            self._save_request = request
            say(self.rank, f"rank {rank} got {signal.Signals(signum).name}: every rank saves a checkpoint at step "
                           f"{target}, then the job stops (within {grace:.0f} s, or without it; a second signal "
                           "stops it at once)")
        elif time.monotonic() > self._save_deadline:
            signum, rank, target = self._save_request
            code, reason = signal_code(signum), (f"rank {rank} got {signal.Signals(signum).name}; the checkpoint of "
                                                 f"step {target} was not saved within the grace time (the newest "
                                                 "complete checkpoint is intact)")
            try:
                code, reason = self.posts.post_stop(store, code, reason)
            except Exception:
                pass
            self._exit(code, reason)

    def _wait_for_signal(self, timeout: float) -> int | None:
        """One of this watchdog's signals if it arrives within `timeout` seconds (else None)."""
        if self._signal_pipe is None:
            self._stop.wait(timeout)
            return None
        return self._signal_pipe.wait(timeout)

    def _dead_peer(self, store, store_errors: bool = True) -> str | None:
        """A local peer whose process is gone without having finished; an unreachable store (its host died
        too) raises, or with `store_errors=False` counts as not finished."""
        def finished(rank: int) -> bool:
            try:
                return self.posts.finished(store, rank)
            except Exception:
                if store_errors:
                    raise
                return False

        return dead_peer(self._peers, finished)

    def _exit(self, code: int, reason: str, wait: float | None = None) -> None:
        """Say why, then exit with `code`. After a failure the main thread gets `wait` (default `grace`) seconds to
        fail on its own (Lightning's teardown, its traceback); after a signal this rank stops at once, and a
        launching process first gives its children `interval + 1` s to read why from its store."""
        if self._stop.is_set():
            return
        self.code = code
        say_stop(self.rank, reason)
        signalled = code != FAILED
        wait = 0.0 if signalled else self.grace if wait is None else wait
        if wait and self._stop.wait(wait):
            return
        if self.on_exit is not None:
            self.on_exit(self.interval + 1.0 if signalled else 0.0)
        if signalled and self.on_signal_stop is not None:
            self.on_signal_stop(code - 128)
        sys.stdout.flush()
        os._exit(code)
