"""FSDP2 over data parallel for one pipeline stage: one unit per stage (one all-gather per stage per pass) or one
per layer (``shard_unit="layer"``: a stage's layers gathered one after the other, each layer computing as soon as its
own weights arrive), and the mixed-precision policy a Lightning precision gives it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

SHARD_UNITS = ("stage", "layer")


def check_shard_unit(shard_unit: str, sharding: str | None = None) -> None:
    """Raise naming the setting when `shard_unit` is unknown, or "layer" where nothing is sharded."""
    if shard_unit not in SHARD_UNITS:
        raise ValueError(f"shard_unit={shard_unit!r} (Hydra: schedule.shard_unit) must be one of {SHARD_UNITS}: "
                         "'stage' shards each pipeline stage as one FSDP unit, 'layer' each of its layers.")
    if shard_unit == "layer" and sharding == "none":
        raise ValueError("shard_unit='layer' (Hydra: schedule.shard_unit=layer) splits FSDP's sharding into one unit "
                         "per layer, and sharding='none' (Hydra: schedule.sharding=none) shards nothing: use "
                         "sharding='full', or shard_unit='stage'.")


def shard_stage(module: nn.Module, dp_mesh: DeviceMesh, mp_policy=None, layers: Sequence[nn.Module] = ()) -> nn.Module:
    """FSDP2-shard one stage: each module of `layers` (the stage's layers, ``shard_unit="layer"``) as its own unit,
    then the stage as the unit of what is left. The schedule's UNSHARD of the stage gathers every unit (in order, on
    the gather stream); each unit's forward waits for its own weights only (``_private.pipelining``).

    Weights stay gathered after forward (``reshard_after_forward=False``): when to free and gather
    them again is decided by the schedule's RESHARD/UNSHARD actions, not by FSDP's own hooks.
    `mp_policy`: FSDP2 MixedPrecisionPolicy (see `stage_mixed_precision`), None: the module's own dtype; a layer's
    unit computes in its dtypes but leaves the outputs' dtype to the stage's (``output_dtype``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy or MixedPrecisionPolicy()
    for layer in layers:
        if next(layer.parameters(), None) is not None:  # (a layer without weights has nothing to gather)
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False, mp_policy=replace(policy, output_dtype=None))
    return fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)


def stage_mixed_precision(precision: str, last_stage: bool):
    """FSDP2 MixedPrecisionPolicy of a sharded stage under Lightning's `precision` (None: no policy).

    "bf16-mixed": the sharded parameters stay fp32 (the optimizer's master weights); FSDP casts them to
    bf16 when it gathers them (all-gathers move bf16), the stage's float inputs are cast to bf16, so the
    whole stage computes in bf16 and sends bf16 activations (and receives bf16 gradients) over p2p.
    Gradients are reduce-scattered, and accumulated between reductions, in fp32 (`reduce_dtype`). The last
    stage returns fp32 outputs (`output_dtype`) so that `pipeline_loss` runs in fp32.
    Other precisions need no policy: "32-true" computes in fp32, "bf16-true" has bf16 parameters already.
    """
    if precision != "bf16-mixed":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32 if last_stage else None
    )
