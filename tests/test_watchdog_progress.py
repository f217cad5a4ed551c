"""The watchdog notes a rank's training step without a store write on the training step; its thread publishes it
(one process, an in-memory store: a second or so)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch.distributed as dist

from lightning_bfpp.watchdog import Watchdog


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
        key = watchdog._key("step", 0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (watchdog._store.check([key]) and watchdog._store.get(key) == b"7"):
            time.sleep(0.02)
        assert watchdog._store.get(key) == b"7"
        watchdog.stop(finished=True)
    finally:
        dist.destroy_process_group()
