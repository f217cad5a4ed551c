"""Which weights a tensor-parallel plan keeps whole still compute with this rank's share of a split projection: found by
following one forward of the decoder layer on 4 tokens (on the meta device when the model is there: no memory). A plan
that splits q/k/v by heads and leaves, inside the same block, an activation's weights (Apertus' xIELU), a per-head norm
(GLM-4-MoE's q/k norms) or mixing coefficients (DiffLlama's lambdas) whole gives those weights each rank's part of
their gradient only; summed over tp it is the gradient of one process. A weight used both ways has no such sum, and
is refused.

The flow: each tensor carries whether it holds this rank's share (split: a column-wise projection's output, a split
parameter) and which whole weights reach it by paths through whole tensors only, or through a split one. A row-wise
projection (and a gathered column-wise one) ends the split; a column-wise projection's input gradient is summed over
tp, so the weights before it are whole there."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

SHARDED = ("colwise", "unit_colwise")  # their output is this rank's heads or features
ENDS_SPLIT = ("rowwise", "unit_rowwise", "rowwise_split_input", "rowwise_rep", "colwise_gather_output", "colwise_rep",
              "mla_kv_a_proj")
_NONE: frozenset[str] = frozenset()


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in `value` (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    return []


class _Stop(Exception):
    """Every block probed: the rest of the layer need not run."""


class _Flow(TorchFunctionMode):
    """Per tensor (by id, kept alive): (split, whole weights reaching it through whole tensors only, through a split
    one). `weights`: id -> name of the weights followed; `split`: ids of split tensors (split parameters)."""

    def __init__(self, weights: dict[int, str], split: set[int]):
        super().__init__()
        self.weights, self.split = weights, split
        self.state: dict[int, tuple[bool, frozenset[str], frozenset[str]]] = {}
        self.alive: list[torch.Tensor] = []
        self.whole: set[str] = set()  # weights whose gradient reaches them whole
        self.partial: set[str] = set()  # ... as this rank's part

    def of(self, t: torch.Tensor) -> tuple[bool, frozenset[str], frozenset[str]]:
        if id(t) in self.state:
            return self.state[id(t)]
        if id(t) in self.weights:
            return False, frozenset({self.weights[id(t)]}), _NONE
        return id(t) in self.split, _NONE, _NONE

    def set(self, out: Any, state: tuple[bool, frozenset[str], frozenset[str]]) -> None:
        for t in tensors(out):
            self.state[id(t)] = state
            self.alive.append(t)

    def record(self, value: Any) -> None:
        """`value` is used whole (a row-wise projection's or the block's output, a column-wise projection's input)."""
        for t in tensors(value):
            _, whole, partial = self.of(t)
            self.whole |= whole
            self.partial |= partial

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        states = [self.of(t) for t in tensors((args, kwargs))]
        if states:
            split = any(s[0] for s in states)
            reach = frozenset().union(*(s[1] | s[2] for s in states)) if split else _NONE
            self.set(out, (True, _NONE, reach) if split else
                     (False, frozenset().union(*(s[1] for s in states)), frozenset().union(*(s[2] for s in states))))
        return out


def partial_weights(layer: nn.Module, kinds: dict[str, str], params: dict[str, dict[str, str]], blocks: list[str],
                    whole: set[str], run) -> tuple[set[str], set[str]]:
    """(weights whose gradient is this rank's part, weights used both ways) among the weights of `blocks` (submodules
    of `layer` that hold column-wise split projections) the plan keeps whole (their names in `layer`; `whole`
    excludes weights a style already handles). `kinds`/`params`: the plan's styles by submodule / own parameter.
    `run(values, device)`: calls the layer with these parameter and buffer values, inputs on `device`: the layer's
    own values on its device when it holds them (routing a mixture of experts needs values), else on the meta
    device."""
    state = [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]
    on_meta = any(t.is_meta for _, t in state)
    meta = {n: torch.empty_like(t, device="meta") if on_meta else t for n, t in state}
    device = torch.device("meta") if on_meta else next((t.device for _, t in state), torch.device("cpu"))
    followed = {n for b in blocks for n, _ in layer.get_submodule(b).named_parameters(prefix=b)} - whole
    flow = _Flow({id(meta[n]): n for n in followed},
                 {id(meta[f"{sub}.{p}"]) for sub, own in params.items() for p in own})
    handles, left = [], set(blocks)

    def done(block: str):
        def hook(_module, _args, out):
            flow.record(out)
            left.discard(block)
            if not left:
                raise _Stop
        return hook

    for sub, style in kinds.items():
        module = layer.get_submodule(sub)
        if style in SHARDED or style in ENDS_SPLIT:
            handles.append(module.register_forward_pre_hook(lambda _m, args: flow.record(args)))
            state = (True, _NONE, _NONE) if style in SHARDED else (False, _NONE, _NONE)
            handles.append(module.register_forward_hook(lambda _m, _a, out, state=state: flow.set(out, state)))
    handles += [layer.get_submodule(b).register_forward_hook(done(b)) for b in blocks]
    try:
        with flow, torch.no_grad(), torch.random.fork_rng(devices=[]):  # draws nothing from the global RNG
            run(meta, device)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    both = flow.partial & flow.whole
    return flow.partial - both, both
