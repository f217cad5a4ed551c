"""Measurements taken while a schedule runs: per-rank compute timeline (bubble) and
saved-activation bytes (allocator-independent memory), plus parameter/grad/optimizer bytes."""
from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .._private.pipelining import time_actions, time_stage_compute
from .._private.torch_api import compiled_graph_count, dtensor_local
from ..layout.mesh import local_tensor


class Timeline:
    """Wraps PipelineStage compute calls and records (kind, stage, micro_batch, start, end) while `enabled`, in
    seconds of ``time.perf_counter``; with ``attach_runtime`` also every action the runtime runs (``actions``: the op's
    name, stage, micro_batch, start, end; sends, receives, gathers and reductions among them). On a CUDA `device` the
    marks are CUDA events on the current stream (a kernel runs after its launch returns: host clocks would time the
    launches), turned into seconds at ``stats``, after waiting for the step's last event only."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.events: list[tuple[str, int, int, Any, Any]] = []
        self.actions: list[tuple[str, int, int | None, Any, Any]] = []
        self.span: tuple[float, float] | None = None  # the last measured step's start and end (seconds)
        self.enabled = True
        self.cuda = device is not None and device.type == "cuda"

    def clock(self) -> Any:
        """Now: perf_counter seconds, or (CUDA) an event recorded on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def clear(self) -> None:
        self.events.clear()
        self.actions.clear()

    def attach(self, stage) -> None:
        def record(kind: str, micro_batch: int, start: Any, end: Any) -> None:
            self.events.append((kind, stage.stage_index, micro_batch, start, end))

        time_stage_compute(stage, record, lambda: self.enabled, self.clock)

    def attach_runtime(self, runtime) -> None:
        def record(op, stage: int, micro_batch: int | None, start: Any, end: Any) -> None:
            self.actions.append((op.value, stage, micro_batch, start, end))

        time_actions(runtime, record, lambda: self.enabled, self.clock)

    def stats(self, step_start: Any, step_end: Any) -> dict[str, float]:
        """Busy time, span and bubble of the step between the marks `step_start` and `step_end` (from ``clock``);
        CUDA events become perf_counter seconds here (``events`` and ``actions`` then hold seconds, as on CPU)."""
        if self.cuda:
            step_end.synchronize()
            host = time.perf_counter() - step_start.elapsed_time(step_end) / 1e3  # step_start on the host clock
            seconds = lambda e: host + step_start.elapsed_time(e) / 1e3  # noqa: E731
            self.events = [(k, s, mb, seconds(a), seconds(b)) for k, s, mb, a, b in self.events]
            self.actions = [(k, s, mb, seconds(a), seconds(b)) for k, s, mb, a, b in self.actions]
            step_start, step_end = host, seconds(step_end)
        self.span = (step_start, step_end)
        busy = sum(e[4] - e[3] for e in self.events)
        span = step_end - step_start
        return {"compute_s": busy, "step_s": span, "bubble_fraction": (span - busy) / busy if busy else 0.0}


class SavedActivationMeter:
    """Peak bytes of tensors saved for backward, counted once per storage; parameters and the step's
    input batch (which exist whatever the schedule) are excluded."""

    def __init__(self, modules: Iterable[nn.Module]):
        self._modules = list(modules)
        self.live: dict[int, list[int]] = {}  # storage ptr -> [refcount, nbytes]
        self.current = 0
        self.peak = 0
        self._param_ptrs: set[int] = set()

    def refresh(self) -> None:
        """Note the storages of the parameters registered right now. FSDP2 registers the gathered
        (unsharded) parameters while a stage is unsharded, so weights autograd saves (e.g. `weight.t()`)
        are not activations. Re-read at every storage not known yet (cost: one pass over the local
        parameters per saved activation; only under FSDP2, the one thing that swaps parameters mid-step)."""
        self._param_ptrs = {
            local_tensor(p).untyped_storage().data_ptr()
            for module in self._modules
            for p in module.parameters()
        }

    @contextmanager
    def track(self, exclude: Iterable[torch.Tensor] = ()):
        batch_ptrs = {t.untyped_storage().data_ptr() for t in exclude}
        self.refresh()
        swapped = any(isinstance(m, FSDPModule) for module in self._modules for m in module.modules())
        meter = self

        class _Held:
            __slots__ = ("tensor", "ptr")

            def __init__(self, t: torch.Tensor, storage: torch.UntypedStorage):
                self.tensor, self.ptr = t, storage.data_ptr()
                entry = meter.live.get(self.ptr)
                if entry is None:
                    meter.live[self.ptr] = [1, storage.nbytes()]
                    meter.current += meter.live[self.ptr][1]
                    meter.peak = max(meter.peak, meter.current)
                else:
                    entry[0] += 1

            def __del__(self):
                entry = meter.live.get(self.ptr)
                if entry is not None:
                    entry[0] -= 1
                    if entry[0] == 0:
                        meter.current -= entry[1]
                        del meter.live[self.ptr]

        def pack(t: torch.Tensor):
            if isinstance(t, nn.Parameter) or t.device.type == "meta":
                return t
            storage = dtensor_local(t).untyped_storage()  # a DTensor (tensor parallel): its local part's storage
            ptr = storage.data_ptr()
            if swapped and ptr not in meter._param_ptrs and ptr not in batch_ptrs:
                meter.refresh()  # FSDP2 may have swapped in gathered parameters since the last look
            if ptr in batch_ptrs or ptr in meter._param_ptrs:
                return t
            # detached: a tensor an op saves of its own output (softmax, attention, log_softmax) has that op as
            # grad_fn, and holding it would close a cycle through autograd's C++ graph that Python's gc cannot see.
            # A graph traversed with retain_graph=True (breadth_first_zb's input-gradient pass) then never let go of
            # such tensors: 2.6x breadth_first's measured peak, growing every measured step.
            return _Held(t.detach(), storage)

        def unpack(x):
            return x.tensor if isinstance(x, _Held) else x

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield self


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = local_tensor(t)
        total += t.numel() * t.element_size()
    return total


def optimizer_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    return sum(
        local_bytes(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        for opt in optimizers
        for state in opt.state.values()
    )


MEMORY_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_peak_bytes")
TIMELINE_KEYS = ("bubble_fraction", "compute_s", "step_s")  # Timeline.stats, per rank under step_stats["timeline"]


def gather_rows(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values` (all-gathered as float64), indexed by global rank. Identical on every rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.stack(every).cpu().tolist()


def gather_stats(local: dict[str, float], per_rank: dict[str, tuple[str, ...]], device: torch.device) -> dict:
    """Every rank's numbers (all-gathered): the max over ranks of each, plus, for each `per_rank` table name,
    {table: {rank: {key: value}}} with that table's keys (byte counts as ints). Identical on every rank."""
    rows = gather_rows(list(local.values()), device)
    names = list(local)
    stats: dict = {k: max(row[c] for row in rows) for c, k in enumerate(names)}
    for table, keys in per_rank.items():
        columns = [names.index(k) for k in keys]
        stats[table] = {rank: {k: (int if k.endswith("_bytes") else float)(row[c]) for k, c in zip(keys, columns)}
                        for rank, row in enumerate(rows)}
    return stats


class CompileCounter:
    """The graphs torch.compile makes during this process's training steps: ``graphs`` in all and ``late`` ones, made
    after the first `warmup` steps (recompiles: a shape, dtype or grad mode the guards did not expect), each late one
    warned about once per step."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup, self.steps, self.graphs, self.late = warmup, 0, 0, 0

    @contextmanager
    def step(self) -> Iterator[None]:
        before = compiled_graph_count()
        try:
            yield
        finally:
            new = compiled_graph_count() - before
            self.steps += 1
            self.graphs += new
            if self.steps > self.warmup and new:
                self.late += new
                warnings.warn(f"bfpp: compiled layers were compiled again in training step {self.steps} ({new} "
                              f"graph(s); {self.late} after step {self.warmup} so far): a shape or dtype changed "
                              "between steps; TORCH_LOGS=recompiles says why.", stacklevel=1)

    def stats(self) -> dict[str, float]:
        return {"compiled_graphs": float(self.graphs), "recompiled_graphs": float(self.late)}
