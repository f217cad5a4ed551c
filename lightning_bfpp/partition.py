# Scope: cut a LightningModule's ordered layers into contiguous stages (balanced by parameter count or
# an explicit layout) and build one nn.Module per local stage that keeps the model's parameter names.
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def layer_names(root: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """Qualified name of each layer inside `root` (so stage state dicts use the model's own keys)."""
    names = {id(mod): name for name, mod in root.named_modules() if name}
    missing = [i for i, layer in enumerate(layers) if id(layer) not in names]
    if missing:
        raise ValueError(
            f"pipeline_layers()[{missing[0]}] is not a submodule of {type(root).__name__}: register every layer "
            "as an attribute (or inside an nn.ModuleList) of the LightningModule."
        )
    result = [names[id(layer)] for layer in layers]
    if len(set(result)) != len(result):
        raise ValueError("pipeline_layers() lists the same module twice.")
    return result


def balanced_layout(weights: Sequence[int], num_stages: int) -> list[int]:
    """Layers per stage: contiguous, at least one layer each, minimising the heaviest stage."""
    n = len(weights)
    if num_stages > n:
        raise ValueError(
            f"{num_stages} stages (pipeline_parallel x loops) need at least as many layers, "
            f"but pipeline_layers() returns {n}; lower pipeline_parallel or loops so that pipeline_parallel x loops <= {n}."
        )
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + max(w, 1))  # parameter-free layers still cost something
    # best[k][i]: minimal max-stage weight splitting the first i layers into k stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    layout, i = [], n
    for k in range(num_stages, 0, -1):
        layout.append(i - cut[k][i])
        i = cut[k][i]
    return layout[::-1]


def check_layout(layout: Sequence[int], num_layers: int | None, num_stages: int) -> list[int]:
    """`layout` (stage_layers) as a list: one positive layer count per stage, summing to `num_layers` (not
    checked while the model is unknown: None)."""
    counts = list(layout) if isinstance(layout, Sequence) and not isinstance(layout, str) else None
    legal = counts is not None and len(counts) == num_stages and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts)
    if legal and (num_layers is None or sum(counts) == num_layers):
        return counts
    total = "" if num_layers is None else f" summing to the {num_layers} layers of pipeline_layers()"
    example = ""
    if num_layers is not None and num_layers >= num_stages:
        even = [num_layers // num_stages + (i < num_layers % num_stages) for i in range(num_stages)]
        example = f"e.g. stage_layers={even}, or "
    raise ValueError(
        f"stage_layers={counts if counts is not None else layout!r} must list {num_stages} positive layer counts "
        f"(one per stage: pipeline_parallel x loops){total}; {example}leave stage_layers unset (None) to "
        "balance the stages by parameter count."
    )


class StageModule(nn.Module):
    """A contiguous run of the model's layers, registered under their original qualified names."""

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]], index: int = 0, rank: int = 0):
        super().__init__()
        self.index, self.rank = index, rank  # global stage index, pipeline rank: named in errors
        self._order: list[str] = [name for name, _ in named_layers]
        for name, layer in named_layers:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            parent.add_module(leaf, layer)

    # Set by the strategy (activation_checkpointing=True): each layer keeps only its inputs for backward
    # and runs its forward again there (torch.utils.checkpoint, non-reentrant). Wrapping happens here, per
    # call, so no module is wrapped and parameter names and state-dict keys stay the model's own.
    activation_checkpointing: bool = False

    def forward(self, *args):
        out = args if len(args) != 1 else args[0]
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for name in self._order:
            layer = self.get_submodule(name)
            inputs = out if isinstance(out, tuple) else (out,)
            try:
                # tensors passed as separate arguments: checkpoint saves them through autograd (so the
                # saved-activation meter counts them) and re-runs layer(*inputs) in backward
                out = checkpoint(layer, *inputs, use_reentrant=False) if recompute else layer(*inputs)
            except Exception as error:  # say where in the pipeline, and what came in (e.g. a new sequence length)
                error.add_note(
                    f"bfpp: in layer {name} of stage {self.index} (pipeline rank {self.rank}; layers "
                    f"{', '.join(self._order)}); stage input {describe(args)}, layer input {describe(inputs)}"
                )
                raise
            if not _passes_between_stages(out):
                raise TypeError(
                    f"bfpp: layer {name} of stage {self.index} returned {type(out).__name__} ({describe([out])}): a "
                    "pipeline layer must return a tensor or a tuple of tensors (its next layer's arguments); return "
                    "a tuple in a fixed order instead of a dict, or wrap the layer."
                )
        return out


def _passes_between_stages(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value))


def describe(values: Sequence[Any]) -> str:
    """'float32[4, 16], int64[4]': dtypes and shapes of tensors (other values by type)."""
    return ", ".join(
        f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
        for v in values
    )


class RemoteLayer(nn.Module):
    """Placeholder for a layer that lives on another pipeline rank (keeps ModuleList indices)."""

    def __init__(self, name: str, stage: int, rank: int):
        super().__init__()
        self.where = f"{name} (stage {stage}, pipeline rank {rank})"

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"layer {self.where} lives on another pipeline rank: under strategy='bfpp' the model runs through the "
            "pipeline. In validation_step/test_step/predict_step call self(x) (it returns the pipeline's output); "
            "outside the Trainer, export the checkpoint (python -m lightning_bfpp.checkpoint) and load it in one process."
        )

    def extra_repr(self) -> str:
        return self.where


def plan_stages(
    root: nn.Module, layers: Sequence[nn.Module], num_stages: int, layout: Sequence[int] | None = None
) -> list[list[str]]:
    """The layer names of every stage, after checking the model against the contract; `root` is not changed.

    Raises ValueError when a layer is not a registered submodule of `root`, a parameter lies outside every
    layer, or the layers do not fill `num_stages` stages (`layout`:
    explicit layers per stage; default: balanced by parameter count).
    """
    names = layer_names(root, layers)
    covered = {f"{n}.{p}" for n, layer in zip(names, layers) for p, _ in layer.named_parameters()}
    stray = [n for n, _ in root.named_parameters() if n not in covered]
    if stray:
        raise ValueError(
            f"parameters {stray[:3]} are not inside any of pipeline_layers(); every parameter must belong to a "
            "layer (put shared pieces such as embeddings into a layer)."
        )
    weights = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    counts = check_layout(layout, len(layers), num_stages) if layout else balanced_layout(weights, num_stages)
    stage_names, start = [], 0
    for c in counts:
        stage_names.append(names[start : start + c])
        start += c
    return stage_names


def split_stages(
    root: nn.Module,
    layers: Sequence[nn.Module],
    num_stages: int,
    local_stages: Sequence[int],
    stage_rank,
    layout: Sequence[int] | None = None,
) -> tuple[dict[int, StageModule], list[list[str]]]:
    """Build the local StageModules; replace layers of other ranks in `root` by RemoteLayer.

    Returns (local stage index -> StageModule, layer names of every stage).
    """
    stage_names = plan_stages(root, layers, num_stages, layout)
    by_name = dict(zip(layer_names(root, layers), layers))
    local = {s: StageModule([(n, by_name[n]) for n in stage_names[s]], s, stage_rank(s)) for s in local_stages}
    for s, group in enumerate(stage_names):
        if s in local:
            continue
        for name in group:
            parent_name, _, leaf = name.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            parent.register_module(leaf, RemoteLayer(name, s, stage_rank(s)))
    return local, stage_names
