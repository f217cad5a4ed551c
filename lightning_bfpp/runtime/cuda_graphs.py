"""Opt-in CUDA-graph capture of every local stage's training pass (``BFPPStrategy(cuda_graphs=True)``, Hydra
``schedule.cuda_graphs=true``), for micro-batches too small to keep a GPU busy: the host then launches one graph per
forward and one per backward instead of every kernel.

Each (stage, micro-batch index, input shapes) gets its own forward and backward graph, captured by torch's
``make_graphed_callables`` at its first training step and replayed after: a breadth-first step keeps every
micro-batch's activations (and, in a graph, its outputs and saved tensors live in the graph's own memory) until its
backward, so one graph per stage could not serve two micro-batches in flight. Evaluation, prediction and torch's
shape inference run the stage eagerly. The weights must stay where they are (FSDP gathers and frees them: refused),
and the stage's own computation must not synchronize with the host.

NOTE: prepared without a GPU (issue 53): the checks run on CPU; the capture itself has run on no device yet
(``benchmarks/device.sh`` holds the first measurement).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._private.pipelining import on_micro_batch
from .._private.torch_api import check_compile
from ..dims import ParallelDims

SETTING = "cuda_graphs=True (Hydra: schedule.cuda_graphs=true)"


def check_runtime_options(device_type: str, dims: ParallelDims, *, compile_layers: bool, cuda_graphs: bool,
                          activation_checkpointing: bool) -> None:
    """Raise naming the setting when the run cannot compile its layers (``check_compile``) or capture CUDA graphs."""
    if compile_layers:
        check_compile(device_type)
    if not cuda_graphs:
        return
    if device_type != "cuda":
        raise ValueError(f"{SETTING} needs a CUDA device: a CUDA graph replays GPU kernels, and this run is on "
                         f"{device_type}. Drop the setting here.")
    reasons = [
        (dims.sharded, f"sharding='full' over data_parallel={dims.data_parallel}: FSDP gathers and frees the weights "
                       "every step, a graph needs them at fixed addresses; use sharding='none' or one replica"),
        (dims.tensor_parallel > 1, f"tensor_parallel={dims.tensor_parallel}: the layers' DTensor collectives are not "
                                   "captured here; use tensor_parallel=1"),
        (activation_checkpointing, "activation_checkpointing=True: a recompute inside a captured backward is not "
                                   "supported; turn it off"),
        (compile_layers, "compile=True: torch.compile(mode='reduce-overhead') makes graphs of its own; choose one"),
    ]
    for broken, why in reasons:
        if broken:
            raise ValueError(f"{SETTING} cannot run with {why}.")


class _Pass(nn.Module):
    """What one graph captures: the stage module's eager forward, the stage registered so that its parameters are
    the graph's (``make_graphed_callables`` returns their gradients)."""

    def __init__(self, stage: nn.Module, eager: Callable[..., Any]) -> None:
        super().__init__()
        self.stage = stage
        self.eager = eager

    def forward(self, *args: torch.Tensor) -> Any:
        return self.eager(*args)


class StageGraphs:
    """Replaces a stage module's ``forward``: in training, with grad on, a graph per micro-batch index and input
    shapes (captured on first use); otherwise the eager forward. ``micro_batch`` is set by the runtime around each
    training forward (``on_micro_batch``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.eager = module, module.forward
        self.graphs: dict[tuple, nn.Module] = {}
        self.micro_batch: int | None = None
        module.forward = self  # an instance attribute: nn.Module.__call__ calls it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graphable = (self.micro_batch is not None and not kwargs and torch.is_grad_enabled() and self.module.training
                     and all(isinstance(a, torch.Tensor) for a in args))
        if not graphable:
            return self.eager(*args, **kwargs)
        key = (self.micro_batch, tuple((a.shape, a.dtype, a.requires_grad) for a in args))
        graphed = self.graphs.get(key)
        if graphed is None:
            graphed = self.graphs[key] = self._capture(args)
        return graphed(*args)

    def _capture(self, args: tuple[torch.Tensor, ...]) -> nn.Module:
        graphed = _Pass(self.module, self.eager).train(self.module.training)
        cached = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)  # make_graphed_callables refuses autocast's weight cache
        try:
            return torch.cuda.make_graphed_callables(graphed, args)
        finally:
            torch.set_autocast_cache_enabled(cached)


def capture_stages(modules: dict[int, nn.Module]) -> dict[int, StageGraphs]:
    """Every local stage module's `StageGraphs` (installed on the module)."""
    return {s: StageGraphs(module) for s, module in modules.items()}


def attach(graphs: dict[int, StageGraphs], stage: Any) -> None:
    """Tell `stage`'s graphs which micro-batch each of its training forwards is (a PipelineStage of a training
    runtime)."""
    holder = graphs[stage.stage_index]

    def set_micro_batch(micro_batch: int | None) -> None:
        holder.micro_batch = micro_batch

    on_micro_batch(stage, set_micro_batch)
