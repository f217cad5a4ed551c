"""Stage_layers="auto" — each pipeline layer's forward+backward time on one micro-batch, measured on the
run's device before the model is cut, and the cut that minimises the slowest stage by those times."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .._private.lightning_api import train_data_source
from ..contract.hooks import loss_parts
from ..contract.layer_io import side_inputs_of
from ..schedule.stage_cut import balanced_stage_layers
from .names import describe_layers
from .stage_inputs import input_kwargs
from .stage_module import StageModule


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else [v for v in value if isinstance(v, torch.Tensor)]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def _fresh(value: Any) -> tuple:
    """A layer's input as fresh autograd leaves (floating tensors require grad), as a stage receives it."""
    values = value if isinstance(value, tuple) else (value,)
    return tuple(v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v for v in values)


def measure_layer_times(
    root: nn.Module,
    layers: Sequence[nn.Module],
    inputs: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    device: torch.device,
    *,
    warmup: int = 1,
    repeats: int = 3,
) -> list[float]:
    """Seconds of forward + backward of each layer on one micro-batch (`inputs`, `target`: ``pipeline_inputs`` of
    a micro-batch), the last layer with ``loss_fn``: the fastest of `repeats` passes over all layers after
    `warmup` passes (passes, not per-layer repeats, so a burst of load on a shared machine hits every layer, and
    the minimum drops what other processes added).

    Each layer runs as a one-layer stage (side inputs and keyword plumbing as in the pipeline), on `device`
    (moved there for its measurement and back). Leaves no trace: RNG states, buffers and ``.grad`` are restored.
    """
    described = describe_layers(root, layers)
    side = side_inputs_of(root)
    params = list(root.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in root.buffers()]
    kwargs = input_kwargs(_to(inputs, device)) if side is not None else {}
    target = _to(target, device)
    n = len(described)
    stages = [StageModule(layer.parts, i, 0, calls=[(layer.name, layer.module)], side_inputs=side, last=i == n - 1)
              for i, layer in enumerate(described)]
    layer_inputs: list[Any] = [_to(inputs, device)]  # filled by the first pass
    samples: list[list[float]] = [[] for _ in range(n)]
    rng_devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=rng_devices, device_type=device.type if rng_devices else "cuda"):
        for r in range(max(warmup, 1) + repeats):
            for i, layer in enumerate(described):
                home = [(mod, next(mod.parameters(), None)) for _, mod in layer.parts]
                for mod, _ in home:
                    mod.to(device)
                args = _fresh(layer_inputs[i])
                _sync(device)
                start = time.perf_counter()
                y = stages[i](*args, **kwargs)
                if i == n - 1 and target is not None:
                    loss_parts(loss_fn(y, target))[0].backward()
                else:
                    outs = [t for t in _tensors(y) if t.requires_grad]
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                _sync(device)
                if r >= max(warmup, 1):
                    samples[i].append(time.perf_counter() - start)
                elif r == 0 and i + 1 < n:
                    layer_inputs.append(y.detach() if isinstance(y, torch.Tensor) else tuple(_tensors(y)))
                for mod, first in home:  # back where the layer was (before the strategy moves the model)
                    if first is not None:
                        mod.to(first.device)
    for p, g in zip(params, grads):
        p.grad = g
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)
    return [min(s) for s in samples]


def sample_micro_batch(module: Any, trainer: Any, micro_batches: int) -> tuple[Any, Any]:
    """(inputs, target) of one micro-batch: the first training batch through ``module.pipeline_inputs``, its
    first 1/`micro_batches` rows; without training data, ``module.example_input_array`` (target None: the last
    layer's backward then runs without the loss)."""
    source = train_data_source(trainer)
    loader = source.dataloader() if source is not None and source.is_defined() else None
    if loader is not None:
        inputs, target = module.pipeline_inputs(next(iter(loader)))
    elif getattr(module, "example_input_array", None) is not None:
        inputs, target = module.example_input_array, None
    else:
        raise ValueError(
            "stage_layers='auto' times every layer on one micro-batch of the training data or of "
            f"{type(module).__name__}.example_input_array; there is neither: set example_input_array, or pass "
            "stage_layers=[...] (or None: balanced by parameter count)."
        )

    def rows(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim():
            return value[: max(1, value.shape[0] // micro_batches)]
        return type(value)(rows(v) for v in value) if isinstance(value, (tuple, list)) else value

    return rows(inputs), rows(target)


def time_balanced_stage_layers(times: Sequence[float], num_stages: int) -> list[int]:
    """Layers per stage minimising the slowest stage's summed time (contiguous, at least one layer each)."""
    # integer costs for balanced_stage_layers, resolution 1e-6 of the slowest layer
    scale = 1e6 / max(max(times), 1e-12)
    return balanced_stage_layers([round(t * scale) for t in times], num_stages)


def stage_sums(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Per-stage sums of per-layer `costs` for the cut `counts`."""
    sums, start = [], 0
    for c in counts:
        sums.append(sum(costs[start : start + c]))
        start += c
    return sums


def auto_stage_layers(module: Any, layers: Sequence[nn.Module], num_stages: int, micro_batches: int,
                      device: torch.device) -> tuple[list[int], list[float], str]:
    """stage_layers="auto": every rank times each layer; the minimum over ranks (the least disturbed sample,
    identical everywhere) decides the cut. Returns (layers per stage, seconds per stage, a line to log)."""
    import torch.distributed as dist

    inputs, target = sample_micro_batch(module, module.trainer, micro_batches)
    measured = measure_layer_times(module, layers, inputs, target, module.pipeline_loss, device, repeats=5)
    times_t = torch.tensor(measured, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(times_t, op=dist.ReduceOp.MIN)
    times = times_t.tolist()
    counts = time_balanced_stage_layers(times, num_stages)
    stage_times = stage_sums(times, counts)
    by_params = balanced_stage_layers([sum(p.numel() for p in layer.parameters()) for layer in layers], num_stages)
    line = (f"bfpp: stage_layers='auto' cut {counts} (by parameter count: {by_params}); forward+backward per stage "
            f"on one micro-batch: {', '.join(f'{t * 1e3:.1f}' for t in stage_times)} ms, by parameter count "
            f"the slowest would be {max(stage_sums(times, by_params)) * 1e3:.1f} ms.")
    return counts, stage_times, line
