"""Lighter versions of torch's per-call Python work in the pipelining runtime, each patched into torch's module at
import (``_private.pipelining`` imports this first): the action's profiler range only while a profiler listens, the
stage's debug description of its outputs only when formatted, and a step's plain tensor inputs split and a
forward's plain inputs flattened without pytrees. Each gives torch's own result (``tests/test_private_apis.py``
compares them) and hands anything else to torch's own function. They are the runtime's host cost per action
(benchmarks/host_overhead.py); the schedule runtime itself is ``_private.pipelining``'s."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch.distributed.pipelining import microbatch as _torch_microbatch
from torch.distributed.pipelining import schedules as _torch_schedules
from torch.distributed.pipelining import stage as _torch_stage

from .versions import check_version

check_version("torch")

_NO_RANGE = nullcontext()  # what `record_function` is when no profiler listens: nothing (reusable)
_record_function = _torch_schedules.record_function


def _ranges_only_when_profiling(name: str, args: str | None = None):
    """torch's runtime opens a profiler range (``record_function("PP:0F1")``) around every action, which costs a few
    microseconds each (two dispatcher calls) whether or not a profiler listens: a sizeable part of a small
    micro-batch's host time. The range is opened as before while torch's profiler runs (``torch.profiler.profile``,
    ``torch.autograd.profiler.profile``), and skipped otherwise. Public alternative checked: none (the call is inside
    ``_step_microbatches``)."""
    return _record_function(name, args) if torch.autograd._profiler_enabled() else _NO_RANGE


_torch_schedules.record_function = _ranges_only_when_profiling

_map_debug_info = _torch_stage.map_debug_info


class _DebugInfo:
    """``map_debug_info(value)`` (torch's description of a stage's tensors: shape, requires_grad, dtype) made when it is
    formatted, not before: ``str``, ``repr`` and ``format`` give what the description itself gives."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        return str(_map_debug_info(self.value))

    def __repr__(self) -> str:
        return repr(_map_debug_info(self.value))

    def __format__(self, spec: str) -> str:
        return format(_map_debug_info(self.value), spec)


def _debug_info_when_formatted(value: Any) -> _DebugInfo:
    """torch's ``forward_one_chunk`` describes every forward's outputs for a ``logger.debug`` line (``map_debug_info``,
    a few microseconds a micro-batch on this CPU) whether or not debug logging is on; its other use is the message of
    a failed forward. The stage module's description is made lazily instead: formatted (the log line when it is
    emitted, logging formats it then; the error message at once) it is the same text. Public alternative checked:
    none (the call is inside ``forward_one_chunk``)."""
    return _DebugInfo(value)


_torch_stage.map_debug_info = _debug_info_when_formatted

_split_args_kwargs_into_chunks = _torch_schedules.split_args_kwargs_into_chunks


def _split_plain_tensors(args: tuple[Any, ...], kwargs: dict[str, Any] | None, chunks: int,
                         args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None) -> tuple[list[tuple], list[dict]]:
    """torch's runtime splits a step's inputs into micro-batches with ``split_args_kwargs_into_chunks``: chunk specs
    built by ``tree_map``, the arguments flattened and unflattened through pytrees, per argument and per micro-batch
    (~100 Python calls a step on this CPU, the same at one micro-batch). Where the inputs are positional plain
    tensors only (no keyword inputs, no chunk specs, no DTensor or BlockMask, torch's debug masking off) its result
    is, by its own steps: each tensor ``tensor_split`` along dim 0 into min(its rows..., `chunks`) parts (the leaf
    tensors needing gradients get ``retain_grad`` on each part), a tuple of the parts per micro-batch and an empty
    dict of keyword inputs for each; made directly here. Anything else goes to torch's own. Public alternative
    checked: none (``step`` calls it; the runtime takes no split inputs)."""
    if (args and not kwargs and args_chunk_spec is None and kwargs_chunk_spec is None
            and all(type(a) is torch.Tensor and a.dim() > 0 for a in args)
            and not _torch_microbatch._debug_mask_minibatches):
        n = min(*(a.size(0) for a in args), chunks)
        if n >= 1:
            parts = []
            for a in args:
                split = torch.tensor_split(a, n, 0)
                if a.requires_grad and a.is_leaf:
                    for part in split:
                        part.retain_grad()
                parts.append(split)
            return [tuple(split[i] for split in parts) for i in range(n)], [{} for _ in range(n)]
    return _split_args_kwargs_into_chunks(args, kwargs, chunks, args_chunk_spec, kwargs_chunk_spec)


_torch_schedules.split_args_kwargs_into_chunks = _split_plain_tensors

_flatten_args = _torch_stage.flatten_args


def _flatten_plain(args: Any, *, detach: bool = False) -> Any:
    """torch's stage flattens every forward's inputs, positional and keyword (``flatten_args``: a pytree
    ``tree_flatten``, ~10 Python calls each), to keep them for the backward. A tuple of plain tensors flattens to
    the list of its tensors and an empty dict to an empty list; made directly here, anything else (and
    ``detach=True``) is torch's own. Public alternative checked: none (the calls are inside ``forward_one_chunk``)."""
    if not detach:
        kind = type(args)
        if kind is tuple and all(type(a) is torch.Tensor for a in args):
            return list(args)
        if kind is dict and not args:
            return []
    return _flatten_args(args, detach=detach)


_torch_stage.flatten_args = _flatten_plain
