# Scope: failure handling across ranks. One daemon thread per rank notices a peer that reported a
# failure or died (killed, out of memory) and takes this rank down with a message naming that peer, so
# no rank waits in a collective until the timeout and no process is left behind.
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

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


class Watchdog:
    """Watches the other ranks of this job through the process group's key-value store.

    - A rank whose run raises posts ``rank R failed: <error>`` (the first post wins); every other rank prints
      it and exits within ``interval + grace`` seconds, even if blocked in a collective.
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
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.interval, self.grace = interval, grace
        self.on_exit = on_exit
        self._store = dist.distributed_c10d._get_default_store()
        # one key space per run (fit, validate, ...) of this job's store: every rank counts its own starts, and
        # every rank starts the same runs; a new store (a new job, e.g. the next one of a Hydra sweep) counts anew
        self.prefix = f"bfpp/watchdog/{self._store.add(f'bfpp/watchdog/starts/{rank}', 1)}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers: dict[int, int] = {}  # rank -> pid, for peers on this host

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
        self._thread = threading.Thread(target=self._watch, args=(self._store.clone(),), daemon=True, name="bfpp-watchdog")
        self._thread.start()

    def stop(self, finished: bool) -> None:
        """Stop watching; `finished` marks a normal end, so peers do not take this rank's exit for a crash."""
        self._stop.set()
        if finished:
            try:
                self._store.set(self._key("done", self.rank), "1")
            except Exception:  # the store's host may already be gone at the very end; nothing waits on this
                pass

    def report(self, error: BaseException) -> str:
        """Say (and post, unless a peer failed first) why the job stops; returns that message. A communication
        error is usually a peer's failure seen from here: look for that peer for up to `grace` seconds."""
        summary = " ".join([str(error).splitlines()[0] if str(error) else "", *getattr(error, "__notes__", [])])
        deadline = time.monotonic() + (self.grace if _is_communication_error(error) else 0.0)
        while True:
            culprit = self._dead_peer(self._store, store_errors=False) or self._posted()
            if culprit or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        culprit = culprit or f"rank {self.rank} failed: {type(error).__name__}: {summary}{self._laggards()}"
        try:
            culprit = self._post(self._store, culprit)
        except Exception:  # the store's host is gone: say what this rank knows
            pass
        message = f"[rank {self.rank}] bfpp: the job stops because {culprit}"
        print(message, file=sys.stderr, flush=True)
        return message

    def progress(self, step: int) -> None:
        """Note the training step this rank has reached (named when a wait times out on a stuck rank)."""
        self._store.set(self._key("step", self.rank), str(step))

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

    def _posted(self) -> str | None:
        try:
            if self._store.check([self._key("failed")]):
                return self._store.get(self._key("failed")).decode()
        except Exception:
            pass
        return None

    # ---- the watching thread -------------------------------------------------------------------------
    def _key(self, kind: str, rank: int | None = None) -> str:
        return f"{self.prefix}/{kind}" if rank is None else f"{self.prefix}/{kind}/{rank}"

    def _watch(self, store) -> None:
        while not self._stop.wait(self.interval):
            try:
                if store.check([self._key("failed")]):
                    posted = store.get(self._key("failed")).decode()
                    if not posted.startswith(f"rank {self.rank} "):
                        self._exit(posted, wait=self.grace)
                        return
                dead = self._dead_peer(store)
            except Exception:
                if not self._stop.wait(self.grace):
                    self._exit("the job's key-value store is gone: rank 0 (or the launcher) stopped")
                return
            if dead is not None:
                try:
                    dead = self._post(store, dead)
                except Exception:
                    pass
                self._exit(dead, wait=self.grace)
                return

    def _post(self, store, reason: str) -> str:
        """Post `reason` as the job's failure unless one is posted already; returns the first one."""
        return store.compare_set(self._key("failed"), "", reason[:1000]).decode()

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

    def _exit(self, reason: str, wait: float = 0.0) -> None:
        """Say why, give the main thread `wait` seconds to fail on its own (Lightning's teardown), then exit."""
        if self._stop.is_set():
            return
        print(f"[rank {self.rank}] bfpp: the job stops because {reason}", file=sys.stderr, flush=True)
        if wait and self._stop.wait(wait):
            return
        if self.on_exit is not None:
            self.on_exit()
        os._exit(1)
