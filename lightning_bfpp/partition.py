# Scope: cut a LightningModule's ordered layers into contiguous stages (balanced by parameter count or
# an explicit layout) and build one nn.Module per local stage that keeps the model's parameter names.
from __future__ import annotations

from collections.abc import Sequence

from torch import nn


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
            f"but pipeline_layers() returns {n}; lower pipeline_parallel or loops."
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


def check_layout(layout: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    layout = list(layout)
    if len(layout) != num_stages or any(n < 1 for n in layout) or sum(layout) != num_layers:
        raise ValueError(
            f"stage_layers={layout} must list {num_stages} positive layer counts (pipeline_parallel x loops) "
            f"summing to the {num_layers} layers of pipeline_layers()."
        )
    return layout


class StageModule(nn.Module):
    """A contiguous run of the model's layers, registered under their original qualified names."""

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]]):
        super().__init__()
        self._order: list[str] = [name for name, _ in named_layers]
        for name, layer in named_layers:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            parent.add_module(leaf, layer)

    def forward(self, *args):
        out = args if len(args) != 1 else args[0]
        for name in self._order:
            layer = self.get_submodule(name)
            out = layer(*out) if isinstance(out, tuple) else layer(out)
        return out


class RemoteLayer(nn.Module):
    """Placeholder for a layer that lives on another pipeline rank (keeps ModuleList indices)."""

    def __init__(self, name: str, stage: int, rank: int):
        super().__init__()
        self.where = f"{name} (stage {stage}, pipeline rank {rank})"

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"layer {self.where} lives on another pipeline rank; run it through the bfpp strategy")

    def extra_repr(self) -> str:
        return self.where


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
    by_name = dict(zip(names, layers))
    local = {s: StageModule([(n, by_name[n]) for n in stage_names[s]]) for s in local_stages}
    for s, group in enumerate(stage_names):
        if s in local:
            continue
        for name in group:
            parent_name, _, leaf = name.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            parent.register_module(leaf, RemoteLayer(name, s, stage_rank(s)))
    return local, stage_names
