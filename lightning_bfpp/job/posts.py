"""What the watchdogs of a job's ranks tell each other through its key-value store, and how it is written: one key
space per run, each rank's process (host and pid), its training step and whether it finished, the stop that ends the
job (``"<exit code> <reason>"``) and a save asked for on a signal (``"<signal> <rank> <step>"``); the first post of a
stop or a save wins. Every call takes the store client to use: the main thread and the watching thread each have
their own."""
from __future__ import annotations

import os
import socket


class Posts:
    """The keys of one run (fit, validate, ...) of a job's watchdogs, and what is read and written under them."""

    def __init__(self, store, rank: int) -> None:
        # one key space per run of this job's store: every rank counts its own starts, and every rank starts the
        # same runs; a new store (a new job, e.g. the next one of a Hydra sweep) counts anew
        self.prefix = f"bfpp/watchdog/{store.add(f'bfpp/watchdog/starts/{rank}', 1)}"

    def key(self, kind: str, rank: int | None = None) -> str:
        return f"{self.prefix}/{kind}" if rank is None else f"{self.prefix}/{kind}/{rank}"

    def local_peers(self, store, rank: int, world_size: int) -> dict[int, int]:
        """Post this process (host and pid), wait for every rank's: {rank: pid} of the other ranks on this host."""
        keys = [self.key("proc", r) for r in range(world_size)]
        host = socket.gethostname()
        store.set(keys[rank], f"{host} {os.getpid()}")
        store.wait(keys)
        peers = {}
        for r, value in enumerate(store.multi_get(keys)):
            peer_host, pid = value.decode().rsplit(" ", 1)
            if r != rank and peer_host == host:
                peers[r] = int(pid)
        return peers

    def post_stop(self, store, code: int, reason: str) -> tuple[int, str]:
        """Post `reason` (and the job's exit `code`) as why the job stops unless one is posted already;
        returns the first one."""
        return _decode_stop(store.compare_set(self.key("failed"), "", f"{code} {reason[:1000]}"))

    def posted_stop(self, store) -> tuple[int, str] | None:
        """(exit code, reason) of the stop posted, if any."""
        if not store.check([self.key("failed")]):
            return None
        return _decode_stop(store.get(self.key("failed")))

    def post_save(self, store, signum: int, rank: int, step: int) -> tuple[int, int, int]:
        """Ask every rank to save at `step` because `rank` got `signum`, unless a save is asked for already;
        returns the first request."""
        return _decode_save(store.compare_set(self.key("save"), "", f"{signum} {rank} {step}"))

    def posted_save(self, store) -> tuple[int, int, int] | None:
        """(signal, rank that got it, step to save at) of the save asked for, if any."""
        if not store.check([self.key("save")]):
            return None
        return _decode_save(store.get(self.key("save")))

    def set_step(self, store, rank: int, step: int) -> None:
        store.set(self.key("step", rank), str(step))

    def steps(self, store, world_size: int) -> list[int] | None:
        """Every rank's training step, once every rank posted one."""
        keys = [self.key("step", r) for r in range(world_size)]
        if not store.check(keys):
            return None
        return [int(v) for v in store.multi_get(keys)]

    def set_finished(self, store, rank: int) -> None:
        """Mark `rank` as finished normally, so its peers do not take its exit for a crash."""
        store.set(self.key("done", rank), "1")

    def finished(self, store, rank: int) -> bool:
        return store.check([self.key("done", rank)])


def _decode_save(value: bytes) -> tuple[int, int, int]:
    """(signal, rank that got it, step to save at) of a posted save: "<signal> <rank> <step>"."""
    signum, rank, step = map(int, value.decode().split())
    return signum, rank, step


def _decode_stop(value: bytes) -> tuple[int, str]:
    """(exit code, reason) of a posted stop: "<code> <reason>"."""
    code, reason = value.decode().split(" ", 1)
    return int(code), reason
