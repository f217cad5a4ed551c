"""Weights shared by layers of different pipeline stages (e.g. an input embedding tied to the
output head). Every stage that uses one holds its own copy; after each pipeline step the copies'
gradients are summed (locally and over the pipeline ranks holding a copy), so identical optimizer
steps keep the copies bit-identical — the single-process model's one tensor, one gradient."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..dims import ParallelDims
from .mesh import local_tensor, shared_group


def find_shared_weights(layers_by_name: dict[str, nn.Module],
                        stage_names: Sequence[Sequence[str]]) -> list[dict[int, str]]:
    """For each parameter used by layers of more than one stage: {stage: qualified name of its use there}."""
    uses: dict[int, dict[int, str]] = {}
    for s, group in enumerate(stage_names):
        for layer_name in group:
            for p_name, p in layers_by_name[layer_name].named_parameters(remove_duplicate=False):
                uses.setdefault(id(p), {}).setdefault(s, f"{layer_name}.{p_name}")
    return [u for u in uses.values() if len(u) > 1]


def _set_parameter(root: nn.Module, name: str, param: nn.Parameter) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, leaf, param)


class TiedWeights:
    """This rank's copies of the weights shared across stages, and how their gradients are summed.

    Build it after the stages are split and before they are sharded or cast: a second local stage using
    a weight gets its own clone (one FSDP unit per stage cannot share a parameter). Every rank must build
    it (process groups are created collectively): one group per (replica, tensor-parallel rank) over the pipeline
    ranks that hold a copy (``ParallelDims.across_pipeline_ranks``).
    """

    def __init__(
        self,
        root: nn.Module,
        shared: list[dict[int, str]],
        local_stages: Iterable[int],
        dims: ParallelDims,
        global_rank: int,
        timeout: timedelta | None = None,
        module_order: dict[str, int] | None = None,
    ) -> None:
        self.root = root
        self.shared = shared
        local = set(local_stages)
        self._names: list[list[str]] = []  # per shared weight: its names in this rank's stages, first stage first
        self._first: list[str | None] = []  # the name whose copy counts in the gradient norm (on the first stage)
        self._source: list[str | None] = []  # the copy whose initial value all copies take (`copy_initial_value`)
        self._groups: list[dist.ProcessGroup | None] = []
        groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for uses in shared:
            stages = sorted(uses)
            pipeline_ranks = tuple(sorted({dims.spec.stage_rank(s) for s in stages}))
            if pipeline_ranks not in groups:
                groups[pipeline_ranks] = self._new_group(dims, pipeline_ranks, global_rank, timeout)
            mine = [uses[s] for s in stages if s in local]
            original = root.get_parameter(mine[0]) if mine else None
            for name in mine[1:]:
                _set_parameter(root, name,
                               nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad))
            self._names.append(mine)
            self._first.append(uses[stages[0]] if stages[0] in local else None)
            # a meta-built model initializes a tensor held twice by its first holder in module order
            # (layout.materialize): that copy; without an order, the first stage's
            order = module_order or {}
            source = min(stages, key=lambda s: (order.get(uses[s].rpartition(".")[0], len(order)), s))
            self._source.append(uses[source] if source in local else None)
            self._groups.append(groups[pipeline_ranks] if mine else None)

    @staticmethod
    def _new_group(
        dims: ParallelDims, pipeline_ranks: tuple[int, ...], global_rank: int, timeout: timedelta | None
    ) -> dist.ProcessGroup | None:
        if len(pipeline_ranks) == 1:
            return None  # every copy lives on this pipeline rank: a local sum
        mine = None
        for ranks in dims.across_pipeline_ranks(pipeline_ranks):  # collective: every rank makes every group, in order
            group = shared_group(ranks, timeout)
            if global_rank in ranks:
                mine = group
        return mine

    def __bool__(self) -> bool:
        return any(self._names)

    def aliases(self) -> dict[str, list[str]]:
        """Every name of a shared weight -> its other names (checkpoints of other layouts may use those)."""
        return {n: [o for o in uses.values() if o != n] for uses in self.shared for n in uses.values()}

    def not_counted(self) -> set[int]:
        """ids of the copies left out of the global gradient norm: each shared weight counts once."""
        return {
            id(self.root.get_parameter(n))
            for names, first in zip(self._names, self._first) for n in names if n != first
        }

    @torch.no_grad()
    def copy_initial_value(self) -> None:
        """Give every copy the value of the copy whose holder comes first in the model's ``named_modules()`` order, as
        in one process (after a meta-device model is initialized per stage, the copies were initialized by different
        modules). Collective over the ranks holding copies; before sharding."""
        for names, source, group in zip(self._names, self._source, self._groups):
            if not names:
                continue
            params = [self.root.get_parameter(n) for n in names]
            value = (self.root.get_parameter(source).detach().clone() if source is not None
                     else torch.zeros_like(params[0]))
            if group is not None:
                dist.all_reduce(value, group=group)  # one rank contributes its value, the others zeros: exact
            for p in params:
                p.copy_(value)

    def sum_gradients(self) -> None:
        """Give every copy the sum of all copies' gradients (after the pipeline step's gradient reduction)."""
        for names, group in zip(self._names, self._groups):
            params = [self.root.get_parameter(n) for n in names]
            if not params or not params[0].requires_grad:
                continue
            grads = [local_tensor(p.grad) if p.grad is not None else None for p in params]
            total = torch.zeros_like(local_tensor(params[0]),
                                     dtype=next((g.dtype for g in grads if g is not None), None))
            for g in grads:
                if g is not None:
                    total += g
            if group is not None:
                dist.all_reduce(total, group=group)
            for p, g in zip(params, grads):
                if g is None:
                    p.grad = _like_param(p, total)
                else:
                    g.copy_(total)


def _like_param(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """A gradient for `param` (a DTensor when the parameter is one) holding the local tensor `local`."""
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local.clone(), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local.clone()
