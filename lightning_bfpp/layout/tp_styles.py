"""ParallelStyles for the parts of a tensor-parallel layer that are neither split by columns nor by rows: weights kept
whole whose gradients are partial (a norm over the heads of a split projection, the rotary part of a latent
projection, any weight computing with this rank's share), parameters split by a plan entry of their own and used as
local tensors by their module's forward, and a block computed whole on the gathered sequence under sequence parallel.
Each gives the gradients of one process."""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .tensor_parallel import SEQUENCE_DIM, replicated


def _style(apply, name: str):
    """A torch ParallelStyle whose ``_apply(module, mesh)`` is `apply`."""
    from torch.distributed.tensor.parallel import ParallelStyle

    cls = type(name, (ParallelStyle,), {"_apply": lambda self, module, mesh: apply(module, mesh),
                                        "__repr__": lambda self: f"{name}()"})
    return cls()


def combined(*styles):
    """One ParallelStyle applying `styles` in turn to the same module (a plan has one style per name)."""
    styles = tuple(s for s in styles if s is not None)
    if len(styles) == 1:
        return styles[0]

    def apply(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for style in styles:
            module = style._apply(module, mesh)
        return module

    return _style(apply, "+".join(type(s).__name__ for s in styles))


def elementwise():
    """A ParallelStyle for a layer without weights that works on each position alone (dropout): under sequence
    parallel it runs on this rank's sequence shard as it is."""
    return _style(lambda module, _mesh: module, "Elementwise")


def _replicate_params(module: nn.Module, mesh: DeviceMesh, names: list[str] | None = None) -> None:
    """`module`'s own parameters (those in `names`) as DTensors replicated over `mesh` (the same values on every
    rank)."""
    from torch.distributed.tensor import DTensor, Replicate

    for name, p in list(module.named_parameters(recurse=False)):
        if not isinstance(p, DTensor) and (names is None or name in names):
            module.register_parameter(name, nn.Parameter(DTensor.from_local(p, mesh, (Replicate(),), run_check=False),
                                                         requires_grad=p.requires_grad))


def replicated_parameters():
    """A ParallelStyle for a module kept whole that reads a replicated DTensor and feeds column-wise split modules (a
    LoRA adapter's A before a split B): its parameters become replicated DTensors, so it computes with DTensors, and
    the gradients, each rank's from its own outputs, are summed over tp by DTensor."""
    def apply(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        _replicate_params(module, mesh)
        return module

    return _style(apply, "ReplicatedParameters")


def sharded_norm():
    """A ParallelStyle for a norm (weights whole on every rank) whose input is this rank's share of a column-wise split
    projection. A norm over one head (its weight as wide as the input's last dimension: q/k norms) normalizes this
    rank's heads; a norm over the whole projection (its weight tp times wider) sums its statistics over the tp group,
    so it computes what one process computes. Either way the weights' gradients are summed over tp (each rank's
    covers its own heads), by DTensor: the input is declared a shard of the whole projection."""
    from torch.distributed.tensor import DTensor, Shard

    def apply(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        _replicate_params(module, mesh)
        weight = next(module.parameters(), None)

        def before(_module, args):
            x = args[0]
            if weight is None or isinstance(x, DTensor) or not isinstance(x, torch.Tensor):
                return None
            per_head = weight.shape[-1] == x.shape[-1]  # else the weight spans the whole projection: split like it
            x = DTensor.from_local(x, mesh, (Shard(x.dim() - 2 if per_head else x.dim() - 1),), run_check=False)
            return (x, *args[1:])

        module.register_forward_pre_hook(before)
        module.register_forward_hook(lambda _m, _args, out: out.to_local() if isinstance(out, DTensor) else out)
        return module

    return _style(apply, "ShardedNorm")


def summed_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`x` unchanged, its gradient summed over `mesh` in backward (each rank's covers only what it computed)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


def latent_projection(shared_width: int):
    """A ParallelStyle for a projection kept whole whose output's last `shared_width` features go, unsplit, to every
    rank's heads (multi-head latent attention's rotary key): their gradient, each rank's from its own heads, is
    summed over tp. The rest of the output reaches the heads through a column-wise projection, which sums its own."""

    def apply(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def after(_module, _args, out):
            kept, shared = out.split([out.shape[-1] - shared_width, shared_width], dim=-1)
            return torch.cat([kept, summed_grad(shared, mesh)], dim=-1)

        module.register_forward_hook(after)
        return module

    return _style(apply, "LatentProjection")


def _use_local(module: nn.Module, names: list[str], grad_placements: Any = None) -> None:
    """While `module` runs, its DTensor parameters `names` are their local tensors (their gradients reach the DTensors
    as `grad_placements`, default: their own placements)."""
    from torch.distributed.tensor import DTensor

    held: dict[str, nn.Parameter] = {}

    def before(mod, _args):
        for name in names:
            p = mod._parameters[name]
            if isinstance(p, DTensor):
                held[name] = p
                mod._parameters[name] = p.to_local(grad_placements=grad_placements)

    def after(mod, _args, _out):
        mod._parameters.update(held)
        held.clear()

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def local_parameters(placements: dict[str, Any]):
    """A ParallelStyle for a module whose own parameters named in `placements` are split (e.g. ``{"sinks":
    Shard(0)}``: one attention sink per head, split with the heads) and used by its forward as this rank's local
    tensors; their gradients stay this rank's share."""
    from torch.distributed.tensor import distribute_tensor

    def apply(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for name, placement in placements.items():
            p = module._parameters[name]
            module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, (placement,)),
                                                         requires_grad=p.requires_grad))
        _use_local(module, list(placements))
        return module

    return _style(apply, "LocalParameters")


def summed_grad_parameters(names: list[str]):
    """A ParallelStyle for a module whose own parameters `names` stay whole on every rank but compute with this
    rank's share of a split projection (an activation's or a per-head norm's weights between the column-wise and
    the row-wise projections): each rank's gradient is its part, summed over tp (a replicated DTensor whose local
    tensor's gradient is partial)."""
    from torch.distributed.tensor import Partial

    def apply(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        _replicate_params(module, mesh, names)
        _use_local(module, names, (Partial(),))
        return module

    return _style(apply, "SummedGradParameters")


def whole_block():
    """A ParallelStyle, under sequence parallel, for a block computed whole (weights not split by the plan, e.g.
    mixture-of-experts routing, or a norm over a gathered projection): its first input, this rank's sequence shard, is
    all-gathered into a plain tensor; its output (or its output's first element) is cut back to this rank's shard.
    Every rank computes the same values and the same gradients, as one process does."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def apply(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters))  # by position or by keyword

        def before(_module, args, kwargs):
            if args:
                return (replicated(args[0], mesh, True, True), *args[1:]), kwargs
            if first in kwargs:
                return args, {**kwargs, first: replicated(kwargs[first], mesh, True, True)}
            return args, kwargs

        def shard(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or x.dim() <= SEQUENCE_DIM:
                return x
            whole = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
            return whole.redistribute(mesh, (Shard(SEQUENCE_DIM),)).to_local()

        def after(_module, _args, _kwargs, out):
            return (shard(out[0]), *out[1:]) if isinstance(out, tuple) else shard(out)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)
        return module

    return _style(apply, "WholeBlock")
