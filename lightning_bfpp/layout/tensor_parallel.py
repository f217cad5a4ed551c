"""Tensor parallel inside the pipeline stages (its layout rule, tp innermost within one node, is in
``dims``). The model's per-layer plan (``pipeline_tp_plan``: torch ParallelStyles by submodule name)
checked before launch, and its application to each local stage's layers (torch's parallelize_module over the
tp mesh) before FSDP shards the stage over data parallel. What crosses stages: the whole activation, or with
sequence parallel each tp rank's sequence shard (B, T/tp, ...): plans then start and end layers on shards."""
from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from fnmatch import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..contract.hooks import defined_hook
from ..dims import TP, Names, ParallelDims
from .names import layer_names

HOOK = "pipeline_tp_plan"
Plans = dict[int, tuple[str, nn.Module, dict]]  # id(layer) -> (layer name, layer, {submodule pattern: ParallelStyle})
SEQUENCE_DIM = 1  # sequence parallel splits activations (B, T, ...) along T


def replicated(x: Any, mesh: DeviceMesh, sharded: bool, local: bool) -> Any:
    """`x` as one tensor replicated over tp: all-gathered from this rank's sequence shard (`sharded`; its gradient
    reduce-scattered in backward), or, already whole, marked replicated (no communication; its gradient, summed over
    every reader, all-reduced once). A DTensor, or its local tensor with `local`."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (Shard(SEQUENCE_DIM) if sharded else Replicate(),), run_check=False)
    x = x.redistribute(mesh, (Replicate(),))
    return x.to_local() if local else x


def _replicate_first_input(sharded: bool, use_local_output: bool):
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicatedInput(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            first = next(iter(inspect.signature(module.forward).parameters))

            def before(_module, args, kwargs):
                if args:
                    return (replicated(args[0], device_mesh, sharded, use_local_output), *args[1:]), kwargs
                if first in kwargs:
                    kwargs = {**kwargs, first: replicated(kwargs[first], device_mesh, sharded, use_local_output)}
                return args, kwargs

            module.register_forward_pre_hook(before, with_kwargs=True)
            return module

        def __repr__(self) -> str:
            return f"{type(self).__name__}(sharded={sharded}, use_local_output={use_local_output})"

    return ReplicatedInput()


def sequence_gather(use_local_output: bool = False):
    """A ParallelStyle for a module that needs the whole sequence (attention, an MLP, an output head): its first
    input, a sequence shard on each tp rank (positional or keyword, as its caller passes it), is all-gathered before
    it runs. It stays a replicated DTensor for column-wise children (one reduce-scatter of their summed input
    gradients in backward), or becomes a plain tensor with `use_local_output` (a module computed whole)."""
    return _replicate_first_input(sharded=True, use_local_output=use_local_output)


def shared_input():
    """A ParallelStyle for a module whose column-wise children read one whole input (attention's q/k/v, an MLP's
    gate and up projections), without sequence parallel: the input is handed on as one replicated DTensor, so their
    input gradients are summed locally and all-reduced once, not once per child."""
    return _replicate_first_input(sharded=False, use_local_output=False)


def replicated_output():
    """A ParallelStyle for a module (a norm) whose output column-wise modules read, without sequence parallel: its
    output becomes one replicated DTensor (no communication), so their input gradients are all-reduced once."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False)


def sequence_parallel_norm(gather_output: bool = False, local_output: bool = False):
    """torch's SequenceParallel for a norm (or dropout): it runs on this rank's sequence shard, its weights
    replicated and their gradients summed over tp. With `gather_output` its output is all-gathered for the
    column-wise modules reading it (Megatron's all-gather after the norm), a replicated DTensor; with `local_output`
    it is the shard as a plain tensor (a norm whose output meets plain tensors: a post-norm's residual sum)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    class GatheredSequenceParallel(SequenceParallel):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            module = super()._apply(module, device_mesh)
            module.register_forward_hook(lambda _m, _args, out: replicated(out, device_mesh, True, False))
            return module

    return GatheredSequenceParallel() if gather_output else SequenceParallel(use_local_output=local_output)


def sequence_scatter():
    """A ParallelStyle for a layer computed whole (an embedding): its output, the same on every tp rank, is cut to
    this rank's sequence shard (a local slice; the gradient is all-gathered back)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(SEQUENCE_DIM))


def _split_dim(module: nn.Module, style) -> int | None:
    """The weight dimension a Colwise/Rowwise style splits on `module` (None: not checked)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(module, nn.Linear):
        return 0 if type(style) is ColwiseParallel else 1 if type(style) is RowwiseParallel else None
    if isinstance(module, nn.Embedding):
        return 1 if type(style) is ColwiseParallel else 0 if type(style) is RowwiseParallel else None
    return None


def check_sequence_length(inputs: Any, dims: ParallelDims) -> None:
    """The layout's sequence rule (``ParallelDims.check_sequence``) on a batch: the length is dim 1 of the first
    input."""
    first = inputs[0] if isinstance(inputs, tuple) else inputs
    if not isinstance(first, torch.Tensor):
        return
    length = first.shape[SEQUENCE_DIM] if first.dim() > SEQUENCE_DIM else None
    where = f"the sequence length (dim {SEQUENCE_DIM} of the first input, shape {tuple(first.shape)})"
    dims.check_sequence(length, Names(sequence=where))


def _plan_hook(root: nn.Module, tensor_parallel: int, sequence_parallel: bool):
    """``root.pipeline_tp_plan`` as a function of (layer name, layer), asked for sequence-parallel plans when on."""
    model = type(root).__name__
    hook = defined_hook(root, HOOK)
    if not callable(hook):
        raise TypeError(
            f"tensor_parallel={tensor_parallel} needs `{model}.{HOOK}(layer_name, layer, tensor_parallel)` returning "
            "each layer's plan ({submodule name: ColwiseParallel() | RowwiseParallel() | ...}, or None to keep a layer "
            "whole); see lightning_bfpp.PipelineHooks (docs/tensor_parallel.md), or set tensor_parallel=1."
        )
    if not sequence_parallel:
        return lambda name, layer: hook(name, layer, tensor_parallel)
    params = inspect.signature(hook).parameters
    if "sequence_parallel" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise TypeError(
            f"sequence_parallel=True: `{model}.{HOOK}` takes no `sequence_parallel` argument, so its plans keep "
            "activations whole. Add `sequence_parallel: bool = False` and return sequence-parallel plans when it is "
            "True (docs/tensor_parallel.md: Sequence parallel), or set sequence_parallel=False."
        )
    return lambda name, layer: hook(name, layer, tensor_parallel, sequence_parallel=True)


def layer_plans(root: nn.Module, layers: Sequence[nn.Module], tensor_parallel: int,
                sequence_parallel: bool = False) -> Plans:
    """Every layer's plan from ``root.pipeline_tp_plan(layer_name, layer, tensor_parallel[, sequence_parallel=True])``,
    checked: each key names (or matches, with ``*``) a submodule, or is "" for the layer itself; each value is a
    torch ParallelStyle; split dimensions divide by tp; no split parameter is shared (tied) with another module;
    with `sequence_parallel`, every layer has a plan (its input and output are sequence shards). Raises naming the
    layer and the rule."""
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

    distributes_params = (ColwiseParallel, RowwiseParallel, SequenceParallel)  # the styles that make weights DTensors
    model = type(root).__name__
    hook = _plan_hook(root, tensor_parallel, sequence_parallel)
    names: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    prefix = {id(m): n for n, m in root.named_modules() if n}
    plans: Plans = {}
    for layer, name in zip(layers, layer_names(root, layers)):
        plan = hook(name, layer)
        if not plan and sequence_parallel:
            raise ValueError(
                f"sequence_parallel=True: {model}.{HOOK}({name!r}, ...) returned no plan, so {name} would run on "
                "a sequence shard as if it were the whole sequence. Give it a plan that gathers the sequence where "
                "it needs it (lightning_bfpp.layout.tensor_parallel.sequence_gather) and returns shards, or set "
                "sequence_parallel=False."
            )
        if not plan:
            continue
        if not isinstance(plan, dict):
            raise TypeError(f"{model}.{HOOK}({name!r}, ...) returned {type(plan).__name__}; return a dict "
                            "{submodule name: ParallelStyle} or None.")
        subs = dict(layer.named_modules())
        for key, style in plan.items():
            where = f"{model}.{HOOK}({name!r}, ...)[{key!r}]"
            if not isinstance(style, ParallelStyle):
                raise TypeError(f"{where} is a {type(style).__name__}; use a torch.distributed.tensor.parallel "
                                "ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...).")
            matched = [(n, m) for n, m in subs.items() if n == key or (n and fnmatch(n, key))]  # "": the layer
            if not matched:
                raise ValueError(f"{where}: {name} has no submodule {key!r}; its submodules are "
                                 f"{[n for n in subs if n][:8]}.")
            for sub_name, sub in matched:
                dim = _split_dim(sub, style)
                weight = getattr(sub, "weight", None)
                if dim is not None and weight is not None and weight.shape[dim] % tensor_parallel:
                    raise ValueError(
                        f"{where}: {type(style).__name__} splits {name}.{sub_name}.weight {tuple(weight.shape)} on "
                        f"dim {dim}, which tensor_parallel={tensor_parallel} does not divide; choose a tensor_parallel "
                        "dividing it, or leave this submodule out of the plan."
                    )
                for p_name, p in sub.named_parameters() if isinstance(style, distributes_params) else ():
                    if len(names.get(id(p), ())) > 1:
                        full = f"{prefix.get(id(sub), name + '.' + sub_name)}.{p_name}"
                        others = [n for n in names[id(p)] if n != full]
                        raise ValueError(
                            f"{where}: {full} is tied to {others[0]} (one weight, two modules); a tied weight "
                            f"cannot be split by the tensor-parallel plan. Leave {key!r} out of the plan for this "
                            "layer (it stays whole on every tensor-parallel rank), or untie the weights."
                        )
        plans[id(layer)] = (name, layer, plan)
    return plans


def apply_plans(plans: Plans, local_modules: Iterable[nn.Module], tp_mesh: DeviceMesh) -> list[str]:
    """Split the local layers by their plans (``parallelize_module`` over `tp_mesh`); returns their names.
    Call after the stages are built, moved to their device and cast, and before FSDP shards them."""
    from torch.distributed.tensor.parallel import parallelize_module

    local = {id(m) for stage in local_modules for m in stage.modules()}
    done = []
    for name, layer, plan in plans.values():
        if any(id(m) in local for m in layer.modules()):
            # torch's styles make new Parameters (requires_grad=True): a frozen weight (LoRA's base) stays frozen
            frozen = {n for n, p in layer.named_parameters() if not p.requires_grad}
            submodules = {k: v for k, v in plan.items() if k}
            if submodules:
                parallelize_module(layer, tp_mesh, submodules)
            if "" in plan:  # the layer itself (torch's plan keys name submodules only)
                parallelize_module(layer, tp_mesh, plan[""])
            for n, p in layer.named_parameters():
                if n in frozen:
                    p.requires_grad_(False)
            done.append(name)
    return done


def grads_like_params(params: Iterable[nn.Parameter]) -> None:
    """Give split parameters' gradients their parameter's layout. DTensor leaves some of them whole (a row-wise
    split embedding's gradient comes back replicated: tp times its share of memory); slicing it is local.
    (FSDP does this itself for the stages it shards.)"""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in params:
            g = p.grad
            if isinstance(p, DTensor) and isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)


def tp_sharded(param: torch.Tensor) -> bool:
    """Whether `param` (or its gradient) is split over the tensor-parallel mesh dimension: its local tensor
    holds a different part on each tp rank (else every tp rank holds the same values)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(param, DTensor):
        return False
    mesh_names = param.device_mesh.mesh_dim_names or ()
    return any(n == TP and not isinstance(pl, Replicate) for n, pl in zip(mesh_names, param.placements))


def sum_over_tp(value: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(value, group=tp_group)
    return value
