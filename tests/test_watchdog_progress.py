"""The watchdog notes a rank's training step without a store write on the training step; its thread publishes it
(one process, an in-memory store: a second or so)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import torch.distributed as dist

from lightning_bfpp.job.watchdog import Watchdog


def test_progress_is_published_by_the_watching_thread_not_the_caller():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        watchdog = Watchdog(0, 1, interval=0.05)
        watchdog.start()  # the watching thread has its own clone of the store
        store, writes = watchdog._store, []
        watchdog._store = SimpleNamespace(set=lambda *args: writes.append(args))  # what the training step would write
        watchdog.progress(7)
        watchdog._store = store
        assert writes == []
        key = watchdog.posts.key("step", 0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (watchdog._store.check([key]) and watchdog._store.get(key) == b"7"):
            time.sleep(0.02)
        assert watchdog._store.get(key) == b"7"
        watchdog.stop(finished=True)
    finally:
        dist.destroy_process_group()


def test_ranks_saying_why_at_once_never_share_a_line():
    """Four ranks print why the job stops into one pipe at the same moment: every message is one whole line (two
    messages written in pieces can interleave as `[rank 0] ... SIGINT[rank 1] ... SIGINT`, hiding rank 1's)."""
    code = ("import sys; from lightning_bfpp.job.ending import say\n"  # (say_stop says one reason once per rank)
            "for _ in range(3000): say(int(sys.argv[1]), 'the job stops because rank 0 got SIGINT')\n")
    # unbuffered (as the tests launch jobs, and many clusters do), print() writes text and newline apart
    read, write = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stderr=write, env=env) for r in range(4)]
    os.close(write)
    with open(read) as pipe:
        lines = pipe.read().splitlines()
    assert [p.wait() for p in procs] == [0] * 4
    whole = re.compile(r"\[rank \d\] bfpp: the job stops because rank 0 got SIGINT")
    assert len(lines) == 12000, len(lines)
    assert all(whole.fullmatch(line) for line in lines), [line for line in lines if not whole.fullmatch(line)][:3]


EXIT_AFTER_STOP = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from lightning_bfpp.job.watchdog import Watchdog
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
def slow_publish(self, store) -> None:  # a store call that takes 0.3 s, as one can on a loaded machine
    try:
        store.wait(["bfpp/never"], timedelta(seconds=0.3))
    except Exception:
        pass
Watchdog._publish_step = slow_publish
class SlowExit:  # the interpreter's shutdown takes a second (as on a loaded machine): the store call returns within it
    def __del__(self):
        time.sleep(1.0)
slow_exit = SlowExit()
watchdog = Watchdog(0, 1, interval=0.0)
watchdog.start()
time.sleep(0.5)
if sys.argv[1] == "without-join":
    watchdog._join = lambda: None
watchdog.stop(finished=True)
"""


def test_a_stopped_watchdog_lets_the_process_exit_cleanly():
    """A process whose watchdog was stopped exits cleanly, without the abort `terminate called without an active
    exception` after `Trainer.fit stopped`: a daemon thread that returns from a store call while the interpreter shuts
    down is ended by a forced unwind, which C++ turns into SIGABRT. `stop` waits for the watching thread; without that
    wait the same script aborts."""
    def run(mode: str, times: int) -> list[tuple[int, bool]]:
        procs = [subprocess.run([sys.executable, "-c", EXIT_AFTER_STOP, mode], capture_output=True, text=True,
                                timeout=60) for _ in range(times)]
        return [(p.returncode, "terminate called" in p.stderr) for p in procs]

    assert run("with-join", 3) == [(0, False)] * 3
    assert run("without-join", 1) == [(-6, True)]  # the test can fail


def test_one_process_reads_its_own_save_request_without_the_store():
    """on_signal="save" in one process: the signal's save request is this process's own, so the training step reads it
    from the watching thread, not through a store round trip on every step; it saves from the request's step on."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        watchdog = Watchdog(0, 1, interval=0.05, save_grace_s=lambda signum: 30.0)
        watchdog.start()
        store, reads = watchdog._store, []
        watchdog._store = SimpleNamespace(check=lambda *args: reads.append(args) or False)  # the training step's
        watchdog.progress(3)
        assert watchdog.save_requested(3) is None
        assert watchdog._ask_for_save(store.clone(), 15)  # what the watching thread does on SIGTERM at step 3
        assert watchdog.save_requested(4) is None and watchdog.save_requested(5) == 15 and reads == []
        watchdog._store = store
        watchdog.stop(finished=True)
    finally:
        dist.destroy_process_group()
