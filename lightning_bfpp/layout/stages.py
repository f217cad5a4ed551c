"""This rank's stages, built in two small steps over the (pp, dp[, tp]) DeviceMesh, torchtitan-style:
`cut` splits the model into its local stages (and gives shared weights a copy per stage), `parallelize`
applies tensor parallel, expert parallel (over the experts' own mesh), activation checkpointing and FSDP2 to them.
The strategy runs the Lightning steps in between (materialize, precision cast, move to the device)."""
from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..dims import PP, TP, ParallelDims
from .cut import split_stages
from .experts import distribute_experts, shard_experts
from .fsdp import shard_stage, stage_mixed_precision
from .materialize import init_hook, materialize
from .mesh import gradient_mesh, parameter_mesh
from .names import named_parts
from .stage_module import StageModule
from .tensor_parallel import apply_plans
from .tied import TiedWeights, find_shared_weights


def cut(module: nn.Module, layers: Sequence[nn.Module], mesh: DeviceMesh, dims: ParallelDims, *,
        stage_layers: Sequence[int] | None, global_rank: int, timeout: timedelta | None, device: torch.device,
        seed: int | None = None) -> tuple[dict[int, StageModule], list[list[str]], TiedWeights]:
    """(this rank's stages by index, every stage's module names, the shared weights' copies). Layers of other
    ranks are replaced in `module` (see ``cut.split_stages``). A model on the meta device (`seed`: the same on every
    rank) gets memory on `device` and its weights for this rank's stages only (``materialize``)."""
    parts = named_parts(module, layers)  # every layer's modules by their names in `module`, before the split
    order = {name: i for i, (name, _) in enumerate(module.named_modules(remove_duplicate=False))}
    spec = dims.spec
    modules, names = split_stages(module, layers, spec.num_stages, spec.local_stages(mesh[PP].get_local_rank()),
                                  spec.stage_rank, stage_layers)
    # weights shared across stages (tied embeddings): one copy per stage, before stages are cast or sharded;
    # copies are summed per (replica, tensor-parallel rank)
    shared = find_shared_weights(parts, names)
    tied = TiedWeights(module, shared, modules, dims, global_rank, timeout, order)
    if seed is not None:
        materialize(module, device, seed, init_hook(module))
        tied.copy_initial_value()  # the copies of a shared weight were initialized by different modules
    return modules, names, tied


def parallelize(modules: dict[int, StageModule], mesh: DeviceMesh, dims: ParallelDims, plans: dict,
                precision: str, *, activation_checkpointing: bool, compile_layers: bool = False,
                expert_mesh: DeviceMesh | None = None, shard_unit: str = "stage") -> bool:
    """Tensor parallel by the model's `plans` (before FSDP), expert parallel over `expert_mesh` (the experts split
    over its EP dimension), activation checkpointing, torch.compile per layer (`compile_layers`, after tensor
    parallel, before FSDP, as torchtitan does), then FSDP2 over data parallel when sharded (over dp x cp under context
    parallel: ``layout.mesh.parameter_mesh``; each experts module its own unit over the experts' copies, EDP; with
    `shard_unit` "layer" each layer its own unit too, ``layout.fsdp.shard_stage``).
    Returns whether FSDP's MixedPrecisionPolicy does "bf16-mixed" (no autocast then)."""
    mesh = parameter_mesh(dims, mesh)
    if plans:
        apply_plans(plans, modules.values(), mesh[TP])
    experts = {}
    if dims.expert_parallel > 1:
        assert expert_mesh is not None, "expert_parallel > 1 needs the experts' mesh (layout.mesh.build_expert_mesh)"
        experts = {s: distribute_experts([stage], expert_mesh) for s, stage in modules.items()}
    for stage in modules.values():
        stage.activation_checkpointing = activation_checkpointing
        if compile_layers:
            stage.compile_layers()
    if not dims.sharded:
        return False
    last = dims.num_stages - 1
    for s, stage in modules.items():
        policy = stage_mixed_precision(precision, last_stage=s == last)
        if experts.get(s):
            shard_experts(experts[s], expert_mesh, dims.gradient_replicas, stage_mixed_precision(precision, False))
        per_layer = shard_unit == "layer"
        shard_stage(stage, gradient_mesh(mesh), policy, stage.layer_modules() if per_layer else ())
        stage.per_layer_units = per_layer
        stage.side_input_dtype = policy.param_dtype if policy is not None else None
    return precision == "bf16-mixed"
