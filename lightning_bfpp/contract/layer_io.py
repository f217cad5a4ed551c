"""How one pipeline layer is called. Side inputs (``pipeline_side_inputs``: values computed once per
micro-batch, such as position ids or rotary cos/sin) go as keyword arguments to the layers whose forward
names them; a tuple output becomes the next layer's positional arguments, a dict its keyword arguments.
What may cross a stage boundary (tensors only, flat) is checked here, naming the layer."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

BOUNDARY_RULE = (
    "only a tensor or a flat tuple of tensors crosses pipeline stages (torch sends tensors, and the receiving "
    "stage must know their structure before the first batch); return a flat tuple in a fixed order, and compute "
    "per-micro-batch values such as position ids, rotary cos/sin or an attention mask in pipeline_side_inputs(inputs): "
    "every stage computes them from the micro-batch's inputs and they never cross stages"
)


class _EachTime:
    """A context manager entered afresh each time (``factory()``'s), so that it can be used more than once."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory, self.open = factory, []

    def __enter__(self) -> Any:
        self.open.append(self.factory())
        return self.open[-1].__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.open.pop().__exit__(*exc)


class LayerCall:
    """A layer and the keyword names its forward takes (read once from its signature)."""

    def __init__(self, layer: nn.Module, name: str):
        self.layer, self.name = layer, name
        self.positional: list[str] = []  # parameters that positional arguments fill, in order
        self.any_positional = False  # forward takes *args
        self.keywords: frozenset[str] | None = frozenset()  # None: any keyword (forward takes **kwargs)
        try:
            params = inspect.signature(layer.forward).parameters.values()
        except (TypeError, ValueError):  # no signature to read: no side inputs
            return
        names = set()
        for p in params:
            self.any_positional |= p.kind is p.VAR_POSITIONAL
            if p.kind is p.VAR_KEYWORD:
                names = None
                break
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                self.positional.append(p.name)
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                names.add(p.name)
        self.keywords = None if names is None else frozenset(names)

    def recompute_contexts(self) -> tuple[Any, Any]:
        """Activation checkpointing's (forward, recompute) contexts: the recompute in backward leaves the layer's
        buffers as the forward left them (BatchNorm would otherwise update its running statistics twice). The
        recompute context can be entered more than once: a split backward (breadth_first_zb's input- and
        weight-gradient passes) recomputes the layer in each."""
        return nullcontext(), _EachTime(lambda: buffers_kept(self.layer))

    def leading_inputs(self, inputs: Any) -> Any:
        """The pipeline inputs this layer, the first, takes when the module computes side inputs: a tuple longer than
        its forward's positional parameters gives it the leading ones; the others (e.g. the document ids of packed
        windows, ``contract.documents``) reach ``pipeline_side_inputs`` only."""
        if isinstance(inputs, tuple) and not self.any_positional and 0 < len(self.positional) < len(inputs):
            kept = inputs[: len(self.positional)]
            return kept if len(kept) > 1 else kept[0]
        return inputs

    def arguments(self, value: Any, side: Mapping[str, Any] | None) -> tuple[tuple, dict[str, Any]]:
        """(args, kwargs) for this layer from the previous layer's output `value` and the side inputs."""
        if isinstance(value, tuple):
            args, kwargs = value, {}
        elif isinstance(value, dict):
            args, kwargs = (), dict(value)
        else:
            args, kwargs = (value,), {}
        if side:
            taken = set(self.positional[: len(args)]) | set(kwargs)  # what the layer's inputs already fill
            for key, v in side.items():
                if key not in taken and (self.keywords is None or key in self.keywords):
                    kwargs[key] = v
        return args, kwargs


@contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Run a forward that must leave no trace on `module`'s buffers (BatchNorm running statistics, counters):
    a forward again for activation checkpointing's recompute, or torch's shape inference. Restores them after."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def no_side_inputs(self: Any, inputs: Any) -> dict[str, Any]:
    """The default ``pipeline_side_inputs`` (``PipelineHooks``'): nothing besides each layer's own inputs."""
    return {}


def side_inputs_of(module: Any) -> Any:
    """The module's ``pipeline_side_inputs`` when it computes anything (None for the default, ``no_side_inputs``)."""
    fn = getattr(module, "pipeline_side_inputs", None)
    if fn is None or getattr(fn, "__func__", None) is no_side_inputs:
        return None
    return fn


def compute_side_inputs(fn: Any, inputs: Any) -> dict[str, Any]:
    side = fn(inputs)
    if not isinstance(side, Mapping) or not all(isinstance(k, str) for k in side):
        raise TypeError(
            f"pipeline_side_inputs(inputs) returned {type(side).__name__}: return a dict of keyword name -> value "
            "(e.g. {'position_ids': ..., 'position_embeddings': (cos, sin)}); each layer whose forward takes that "
            "keyword (or **kwargs) receives it."
        )
    return dict(side)


def check_boundary(value: Any, where: str) -> None:
    """Raise a TypeError naming `where` (a layer and its stage) when `value` cannot cross a stage boundary."""
    if isinstance(value, torch.Tensor) or (isinstance(value, tuple)
                                           and all(isinstance(v, torch.Tensor) for v in value)):
        return
    raise TypeError(f"bfpp: {where} returned {describe_structure(value)}: {BOUNDARY_RULE}.")


def describe_structure(value: Any) -> str:
    """'tuple(float32[2, 16], tuple(float32[16, 8], float32[16, 8]))': the structure of a layer output."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(describe_structure(v) for v in value)})"
    if isinstance(value, dict):
        return "dict(" + ", ".join(f"{k}={describe_structure(v)}" for k, v in value.items()) + ")"
    return type(value).__name__
