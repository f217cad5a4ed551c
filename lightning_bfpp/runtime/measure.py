"""When a training step is measured (measure_every_n_steps) and what it reports: the runner's timeline
(bubble, compute time) and this rank's bytes, gathered so that every rank holds the same numbers."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..schedule.checks import is_count
from .instrument import MEMORY_KEYS, TIMELINE_KEYS, gather_stats, local_bytes, optimizer_bytes


def check_every_n_steps(every_n_steps: int | None) -> int | None:
    if every_n_steps is not None and not is_count(every_n_steps, 0):
        raise ValueError(f"measure_every_n_steps={every_n_steps!r} must be None (Lightning's logging steps), a "
                         "positive integer N (every N-th step) or 0 (never).")
    return every_n_steps


def measure_now(trainer: Any, every_n_steps: int | None) -> bool:
    """Whether this training step is measured (the same answer on every rank: the gather is collective).
    None: Lightning's logging steps (``log_every_n_steps``) and the last step; N: every N-th step; 0: never."""
    n = trainer.log_every_n_steps if every_n_steps is None else every_n_steps
    step = trainer.global_step + 1  # Lightning's count: its logging steps are those where this is a multiple of n
    last = every_n_steps is None and 0 < trainer.max_steps <= step
    return bool(n) and (step % n == 0 or last)


def step_stats(runner: Any, params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor], optimizers: list,
               device: torch.device) -> dict[str, Any]:
    """Per-step measurements, identical on every rank: the max over ranks of each number (bubble, times, bytes);
    every rank's own byte counts under "memory" and its own bubble, compute and step time under "timeline"
    ({global rank: {...}}: which rank waits, which one the others wait for)."""
    local = {
        **runner.last_stats,
        "param_bytes": local_bytes(params),
        "grad_bytes": local_bytes(grads),
        "optimizer_bytes": optimizer_bytes(optimizers),
        "activation_peak_bytes": runner.meter.peak,
        "p2p_message_bytes": runner.message_bytes,  # one activation message (its gradient is as large)
        # context parallel: one attention layer's all-gathered keys and values (their gradients' reduce-scatter: as
        # many)
        "kv_gather_bytes": runner.context.shard.stats.get("kv_gather_bytes", 0) if runner.context else 0,
        **(runner.compiled.stats() if runner.compiled is not None else {}),
    }
    memory_keys = MEMORY_KEYS
    if device.type == "cuda":  # what the CUDA caching allocator held at most since the last measured step
        local["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        local["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        memory_keys += ("cuda_max_allocated_bytes", "cuda_max_reserved_bytes")
    return gather_stats(local, {"memory": memory_keys, "timeline": TIMELINE_KEYS}, device)
