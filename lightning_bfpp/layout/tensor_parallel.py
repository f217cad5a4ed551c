# Scope: tensor parallel inside the pipeline stages (its layout rule, tp innermost within one node, is in
# ``schedule.dims``). The model's per-layer plan (``pipeline_tp_plan``: torch ParallelStyles by submodule name)
# checked before launch, and its application to each local stage's layers (torch's parallelize_module over the
# tp mesh) before FSDP shards the stage over data parallel. What crosses stages stays the full activation: plans end layers replicated.
from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .mesh import TP
from .partition import layer_names

HOOK = "pipeline_tp_plan"
Plans = dict[int, tuple[str, nn.Module, dict]]  # id(layer) -> (layer name, layer, {submodule pattern: ParallelStyle})


def _split_dim(module: nn.Module, style) -> int | None:
    """The weight dimension a Colwise/Rowwise style splits on `module` (None: not checked)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(module, nn.Linear):
        return 0 if type(style) is ColwiseParallel else 1 if type(style) is RowwiseParallel else None
    if isinstance(module, nn.Embedding):
        return 1 if type(style) is ColwiseParallel else 0 if type(style) is RowwiseParallel else None
    return None


def layer_plans(root: nn.Module, layers: Sequence[nn.Module], tensor_parallel: int) -> Plans:
    """Every layer's plan from ``root.pipeline_tp_plan(layer_name, layer, tensor_parallel)``, checked: each key
    names (or matches, with ``*``) a submodule, or is "" for the layer itself; each value is a torch ParallelStyle;
    split dimensions divide by tp; no split parameter is shared (tied) with another module. Raises naming the layer
    and the rule."""
    from torch.distributed.tensor.parallel import ParallelStyle

    model = type(root).__name__
    hook = getattr(root, HOOK, None)
    if not callable(hook):
        raise TypeError(
            f"tensor_parallel={tensor_parallel} needs `{model}.{HOOK}(layer_name, layer, tensor_parallel)` returning "
            "each layer's plan ({submodule name: ColwiseParallel() | RowwiseParallel() | ...}, or None to keep a layer "
            "whole); see lightning_bfpp.PipelineHooks (README: Tensor parallel), or set tensor_parallel=1."
        )
    names: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    prefix = {id(m): n for n, m in root.named_modules() if n}
    plans: Plans = {}
    for layer, name in zip(layers, layer_names(root, layers)):
        plan = hook(name, layer, tensor_parallel)
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
                for p_name, p in sub.named_parameters():
                    if len(names.get(id(p), ())) > 1:
                        full = f"{prefix.get(id(sub), name + '.' + sub_name)}.{p_name}"
                        others = [n for n in names[id(p)] if n != full]
                        raise ValueError(
                            f"{where}: {full} is tied to {others[0]} (one weight, two modules); a tied weight cannot be "
                            f"split by the tensor-parallel plan. Leave {key!r} out of the plan for this layer (it stays "
                            "whole on every tensor-parallel rank), or untie the weights."
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
            submodules = {k: v for k, v in plan.items() if k}
            if submodules:
                parallelize_module(layer, tp_mesh, submodules)
            if "" in plan:  # the layer itself (torch's plan keys name submodules only)
                parallelize_module(layer, tp_mesh, plan[""])
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
