"""Cut a LightningModule's ordered layers into contiguous stages (balanced by parameter count, or explicit layers
per stage) and build this rank's stage modules; other ranks' layers become placeholders in the model."""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..contract.layer_io import side_inputs_of
from ..schedule.checks import is_count
from ..schedule.stage_cut import balanced_stage_layers
from .names import Layer, describe_layers
from .remote import RemoteLayer, check_not_cut
from .stage_module import StageModule


def check_stage_layers(stage_layers: Sequence[int], num_layers: int | None, num_stages: int) -> list[int]:
    """`stage_layers` as a list: one positive layer count per stage, summing to `num_layers` (not
    checked while the model is unknown: None)."""
    counts = list(stage_layers) if isinstance(stage_layers, Sequence) and not isinstance(stage_layers, str) else None
    legal = counts is not None and len(counts) == num_stages and all(is_count(n) for n in counts)
    if legal and (num_layers is None or sum(counts) == num_layers):
        return counts
    total = "" if num_layers is None else f" summing to the {num_layers} layers of pipeline_layers()"
    example = ""
    if num_layers is not None and num_layers >= num_stages:
        even = [num_layers // num_stages + (i < num_layers % num_stages) for i in range(num_stages)]
        example = f"e.g. stage_layers={even}, or "
    raise ValueError(
        f"stage_layers={counts if counts is not None else stage_layers!r} must list {num_stages} positive layer counts "
        f"(one per stage: pipeline_parallel x loops){total}; {example}leave stage_layers unset (None) to "
        "balance the stages by parameter count, or set stage_layers='auto' to balance them by measured time."
    )


def _stage_groups(
    root: nn.Module, layers: Sequence[nn.Module], num_stages: int, stage_layers: Sequence[int] | None
) -> list[list[Layer]]:
    check_not_cut(root)
    described = describe_layers(root, layers)
    covered = {id(p) for layer in described for _, mod in layer.parts for p in mod.parameters()}
    stray: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        if id(p) not in covered:
            stray.setdefault(id(p), []).append(name)
    if stray:
        shown = [" (also ".join(names[:2]) + (")" if len(names) > 1 else "") for names in list(stray.values())[:3]]
        raise ValueError(
            f"parameters {shown} are not inside any of pipeline_layers(); every parameter must belong to a "
            "layer (put shared pieces such as embeddings into a layer)."
        )
    weights = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    counts = (check_stage_layers(stage_layers, len(layers), num_stages) if stage_layers
              else balanced_stage_layers(weights, num_stages))
    stages, start = [], 0
    for c in counts:
        stages.append(described[start : start + c])
        start += c
    return stages


def plan_stages(
    root: nn.Module, layers: Sequence[nn.Module], num_stages: int, stage_layers: Sequence[int] | None = None
) -> list[list[str]]:
    """The qualified names (in `root`) of every stage's modules, after checking the model against the contract;
    `root` is not changed. A layer the root registers is named as such (``blocks.3``); a wrapper layer contributes
    the modules it wraps, under the names the root gives them (see `describe_layers`).

    Raises ValueError when a layer's state is not registered in `root`, a parameter lies outside every layer, a
    module has two names, or the layers do not fill `num_stages` stages (`stage_layers`: explicit layers per stage;
    default: balanced by parameter count).
    """
    groups = _stage_groups(root, layers, num_stages, stage_layers)
    return [[name for layer in group for name, _ in layer.parts] for group in groups]


def split_stages(
    root: nn.Module,
    layers: Sequence[nn.Module],
    num_stages: int,
    local_stages: Sequence[int],
    stage_rank,
    stage_layers: Sequence[int] | None = None,
) -> tuple[dict[int, StageModule], list[list[str]]]:
    """Build the local StageModules; replace the state of other ranks' layers in `root` by RemoteLayer, and a
    wrapper layer that `root` registers by an unregistered reference (each parameter keeps one name).

    Returns (local stage index -> StageModule, qualified names of every stage's modules).
    """
    stages = _stage_groups(root, layers, num_stages, stage_layers)
    side = side_inputs_of(root)
    local = {
        s: StageModule([p for layer in stages[s] for p in layer.parts], s, stage_rank(s),
                       calls=[(layer.name, layer.module) for layer in stages[s]], side_inputs=side,
                       last=s == num_stages - 1)
        for s in local_stages
    }
    for s, group in enumerate(stages):
        for layer in group:
            for name in layer.slots:
                _replace(root, name, _Alias(layer.module) if s in local else RemoteLayer(layer.name, s, stage_rank(s)))
            if s not in local:
                for name, _ in layer.parts:
                    _replace(root, name, RemoteLayer(name, s, stage_rank(s)))
    return local, [[name for layer in group for name, _ in layer.parts] for group in stages]


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    parent.register_module(leaf, module)


class _Alias(nn.Module):
    """Stands where the LightningModule registered a wrapper layer: calls it without registering it (its
    parameters are registered once, under the model's own names)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.__dict__["layer"] = layer

    def forward(self, *args, **kwargs):
        return self.__dict__["layer"](*args, **kwargs)
