"""Failure handling across ranks. One daemon thread per rank notices a peer that reported a
failure, died (killed, out of memory) or got a stop signal (SIGTERM, SIGINT, SLURM's requeue signal) and
takes this rank down with a message naming that peer and, for signals, the signal. Every rank ends with the
job's exit code, so no rank waits in a collective until the timeout and no process is left behind."""
from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from .._private.torch_api import default_store

FAILED = 1  # exit code of every rank when a rank failed (raised, died, lost the store, timed out)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_code(signum: int) -> int:
    """Exit code of every rank when a rank got `signum`: the shell's 128 + N (SIGTERM 143, SIGINT 130)."""
    return 128 + int(signum)


def say_stop(rank: int, reason: str) -> str:
    """Print why the job stops as one line (see ``_say``)."""
    return _say(rank, f"the job stops because {reason}")


def _say(rank: int, text: str) -> str:
    """Print `[rank R] bfpp: <text>` as one write of one line, so ranks sharing a terminal or pipe never interleave."""
    message = f"[rank {rank}] bfpp: {text}"
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (message + "\n").encode())  # one write under PIPE_BUF is atomic
    except (AttributeError, OSError, ValueError):  # a stream without a file descriptor (e.g. a notebook's)
        print(message, file=sys.stderr, flush=True)
    return message


def pid_alive(pid: int) -> bool:
    """Whether a local process exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _is_communication_error(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, dist.DistError) or any(k in text for k in ("gloo", "NCCL", "Connection", "connection"))


class _Relay:
    """This process's handler for a stop signal while a watchdog runs. It does nothing in the main thread (which
    may be anywhere in a pipeline step): the signal reaches the watchdog thread through the wakeup fd, even when
    the main thread is blocked in a collective. Without a running watchdog it behaves like the handler it replaced."""

    def __init__(self, watchdog: Watchdog, previous) -> None:
        self.watchdog = watchdog
        self.previous = previous.previous if isinstance(previous, _Relay) else previous

    def __call__(self, signum: int, frame) -> None:
        if self.watchdog.watching:
            return
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous != signal.SIG_IGN:  # the default action (terminate)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


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
        self._wakeup: tuple[int, int] | None = None  # (read fd, write fd) of the signal pipe
        self._old_wakeup = -1
        self._old_handlers: dict[int, object] = {}
        self._store = default_store()
        # one key space per run (fit, validate, ...) of this job's store: every rank counts its own starts, and
        # every rank starts the same runs; a new store (a new job, e.g. the next one of a Hydra sweep) counts anew
        self.prefix = f"bfpp/watchdog/{self._store.add(f'bfpp/watchdog/starts/{rank}', 1)}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers: dict[int, int] = {}  # rank -> pid, for peers on this host
        self._step: int | None = None  # the training step this rank has reached (`progress`)
        self._published_step: int | None = None  # the last one written to the store

    # ---- lifecycle (main thread) ---------------------------------------------------------------------
    def start(self) -> None:
        """Publish this process, learn which peers share this host (waits for every rank), start watching."""
        keys = [self._key("proc", r) for r in range(self.world_size)]
        host = socket.gethostname()
        self._store.set(keys[self.rank], f"{host} {os.getpid()}")
        self._store.wait(keys)
        for r, value in enumerate(self._store.multi_get(keys)):
            peer_host, pid = value.decode().rsplit(" ", 1)
            if r != self.rank and peer_host == host:
                self._peers[r] = int(pid)
        if threading.current_thread() is threading.main_thread():
            self._wakeup = os.pipe()
            for fd in self._wakeup:
                os.set_blocking(fd, False)
            self._old_wakeup = signal.set_wakeup_fd(self._wakeup[1], warn_on_full_buffer=False)
            self._old_handlers = {s: signal.getsignal(s) for s in self.signals}
            self.claim_signals()
        self._thread = threading.Thread(target=self._watch, args=(self._store.clone(),), daemon=True, name="bfpp-watchdog")
        self._thread.start()

    @property
    def watching(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def claim_signals(self) -> None:
        """(Re)install this watchdog's handlers for its signals, e.g. after Lightning installed its own SIGTERM
        handler (which broadcasts from inside the handler, so ranks meet in collectives that never match)."""
        if self._wakeup is None or threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            current = signal.getsignal(s)
            if not (isinstance(current, _Relay) and current.watchdog is self):
                signal.signal(s, _Relay(self, current))

    def stop(self, finished: bool) -> None:
        """Stop watching; `finished` marks a normal end, so peers do not take this rank's exit for a crash."""
        self._stop.set()
        if self._wakeup is not None and threading.current_thread() is threading.main_thread():
            for s, handler in self._old_handlers.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._wakeup[1])  # the read end is closed by the watching thread
        if finished:
            try:
                self._store.set(self._key("done", self.rank), "1")
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
            _say(self.rank, f"the watchdog thread did not stop within {self.interval + self.grace:.0f} s (a store "
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
        code, culprit = posted or (FAILED, culprit or f"rank {self.rank} failed: {type(error).__name__}: {summary}{self._laggards()}")
        try:
            code, culprit = self._post(self._store, code, culprit)
        except Exception:  # the store's host is gone: say what this rank knows
            pass
        self.code = code
        return say_stop(self.rank, culprit)

    def progress(self, step: int) -> None:
        """Note the training step this rank has reached (named when a wait times out on a stuck rank). Only noted
        here: the watching thread writes it to the store (within `interval` seconds), off the training step."""
        self._step = step

    def save_requested(self, step: int) -> int | None:
        """The signal that asked for a save at `step` (an optimizer step boundary every rank checks), else None.

        The rank that got the signal asks for a save at its step + 2: every other rank is at most one step ahead of
        it (each step's collectives need all ranks), so each reads the request here at that step, and all save there."""
        if self.save_grace_s is None:
            return None
        try:
            if not self._store.check([self._key("save")]):
                return None
            signum, rank, target = _decode_save(self._store.get(self._key("save")))
        except Exception:  # the store is gone: the watching thread ends this rank
            return None
        if step < target:
            return None
        self.code, self.signalled_rank = signal_code(signum), rank
        return signum

    def _publish_step(self, store) -> None:
        step = self._step
        if step is not None and step != self._published_step:
            store.set(self._key("step", self.rank), str(step))
            self._published_step = step

    def _laggards(self) -> str:
        """'; rank 3 did not reach step N ...' when some ranks are behind the step the others are in."""
        try:
            keys = [self._key("step", r) for r in range(self.world_size)]
            if not self._store.check(keys):
                return ""
            steps = [int(v) for v in self._store.multi_get(keys)]
        except Exception:
            return ""
        behind = [r for r, step in enumerate(steps) if step < max(steps)]
        if not behind:
            return ""
        who = ", ".join(map(str, behind))
        return (f"; rank{'s' if len(behind) > 1 else ''} {who} did not reach step {max(steps)} like the others "
                f"(stuck or much slower)")

    def _posted(self) -> tuple[int, str] | None:
        try:
            if self._store.check([self._key("failed")]):
                return _decode(self._store.get(self._key("failed")))
        except Exception:
            pass
        return None

    # ---- the watching thread -------------------------------------------------------------------------
    def _key(self, kind: str, rank: int | None = None) -> str:
        return f"{self.prefix}/{kind}" if rank is None else f"{self.prefix}/{kind}/{rank}"

    def _watch(self, store) -> None:
        try:
            self._watch_until_stop(store)
        finally:
            if self._wakeup is not None:
                os.close(self._wakeup[0])

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
                    code, reason = self._post(store, code, reason)
                except Exception:  # the store's host is gone: say what this rank knows
                    pass
                self._exit(code, reason)
                return
            try:
                self._publish_step(store)
                self._save_under_way(store)
                if store.check([self._key("failed")]):
                    code, posted = _decode(store.get(self._key("failed")))
                    if code != FAILED or not posted.startswith(f"rank {self.rank} "):
                        self._exit(code, posted)
                        return
                dead = self._dead_peer(store)
            except Exception:
                if not self._stop.wait(self.grace):
                    self._exit(FAILED, "the job's key-value store is gone: rank 0 (or the launcher) stopped", wait=0.0)
                return
            if dead is not None:
                code = FAILED
                try:
                    code, dead = self._post(store, code, dead)
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
            posted = store.compare_set(self._key("save"), "", f"{signum} {self.rank} {self._step + 2}")
            self._save_under_way(store, _decode_save(posted))
        except Exception:  # the store's host is gone
            return False
        return True

    def _save_under_way(self, store, request: tuple[int, int, int] | None = None) -> None:
        """Once a save is asked for (by any rank): say so, and end this rank when it takes longer than its grace."""
        if self.save_grace_s is None:
            return
        if self._save_deadline is None:
            if request is None:
                if not store.check([self._key("save")]):
                    return
                request = _decode_save(store.get(self._key("save")))
            signum, rank, target = request
            grace = self.save_grace_s(signum)
            self._save_deadline = time.monotonic() + grace
            self._save_request = request
            _say(self.rank, f"rank {rank} got {signal.Signals(signum).name}: every rank saves a checkpoint at step "
                            f"{target}, then the job stops (within {grace:.0f} s, or without it; a second signal "
                            "stops it at once)")
        elif time.monotonic() > self._save_deadline:
            signum, rank, target = self._save_request
            code, reason = signal_code(signum), (f"rank {rank} got {signal.Signals(signum).name}; the checkpoint of "
                                                 f"step {target} was not saved within the grace time (the newest "
                                                 "complete checkpoint is intact)")
            try:
                code, reason = self._post(store, code, reason)
            except Exception:
                pass
            self._exit(code, reason)

    def _wait_for_signal(self, timeout: float) -> int | None:
        """One of this watchdog's signals if it arrives within `timeout` seconds (else None)."""
        if self._wakeup is None:
            self._stop.wait(timeout)
            return None
        try:
            if select.select([self._wakeup[0]], [], [], timeout)[0]:
                for signum in os.read(self._wakeup[0], 512):
                    if signum in self.signals:
                        return signum
        except (OSError, ValueError):  # the pipe was closed by stop()
            pass
        return None

    def _post(self, store, code: int, reason: str) -> tuple[int, str]:
        """Post `reason` (and the job's exit `code`) as why the job stops unless one is posted already;
        returns the first one."""
        return _decode(store.compare_set(self._key("failed"), "", f"{code} {reason[:1000]}"))

    def _dead_peer(self, store, store_errors: bool = True) -> str | None:
        """A local peer whose process is gone without having finished; an unreachable store (its host died
        too) raises, or with `store_errors=False` counts as not finished."""
        for r, pid in self._peers.items():
            if pid_alive(pid):
                continue
            try:
                if store.check([self._key("done", r)]):
                    continue
            except Exception:
                if store_errors:
                    raise
            return f"rank {r} (pid {pid}) died without reporting an error: it was killed (e.g. SIGKILL, out of memory) or crashed"
        return None

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


def _decode_save(value: bytes) -> tuple[int, int, int]:
    """(signal, rank that got it, step to save at) of a posted save: "<signal> <rank> <step>"."""
    signum, rank, step = map(int, value.decode().split())
    return signum, rank, step


def _decode(value: bytes) -> tuple[int, str]:
    """(exit code, reason) of a posted stop: "<code> <reason>"."""
    code, reason = value.decode().split(" ", 1)
    return int(code), reason
