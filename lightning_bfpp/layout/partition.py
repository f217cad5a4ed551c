"""Cut a LightningModule's ordered layers into contiguous stages (balanced by parameter count or
explicit layers per stage) and build one nn.Module per local stage that keeps the model's parameter names."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..contract.layer_io import LayerCall, check_boundary, compute_side_inputs, describe_structure, side_inputs_of
from ..schedule.stage_cut import balanced_stage_layers


@dataclass
class Layer:
    """One entry of pipeline_layers() and where its state lives in the root module.

    `parts`: (qualified name in root, module) pairs a stage registers, so its parameter names are the root's own:
    the layer itself when the root registers it (``blocks.3``), or, for a wrapper around modules the root registers
    elsewhere (``self.hf = GPT2LMHeadModel(...)`` and a wrapper around ``hf.transformer.wte``), those modules under
    their names there. `slots`: names under which the root also registers such a wrapper (re-pointed after the split
    so every parameter keeps one name).
    """

    index: int
    module: nn.Module
    name: str
    parts: list[tuple[str, nn.Module]]
    slots: list[str] = field(default_factory=list)


def describe_layers(root: nn.Module, layers: Sequence[nn.Module]) -> list[Layer]:
    """Name every layer's state by where `root` first registers it (the names of ``root.named_modules()``, as in
    its state dict); raise naming the layer when that is impossible."""
    canonical = {id(mod): name for name, mod in root.named_modules() if name}  # first registration wins
    every: dict[int, list[str]] = {}
    for name, mod in root.named_modules(remove_duplicate=False):
        if name:
            every.setdefault(id(mod), []).append(name)
    slots = {n for layer in layers for n in every.get(id(layer), [])}

    def through_slot(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:k]) in slots for k in range(1, len(parts) + 1))

    described = []
    for i, layer in enumerate(layers):
        own = canonical.get(id(layer))
        if own is not None and all(_under(canonical.get(id(m), ""), own) for m in layer.modules()):
            parts = [(own, layer)]
            label = own
        else:  # a wrapper around modules registered elsewhere (or not registered itself)
            parts = []
            label = f"pipeline_layers()[{i}] ({type(layer).__name__})"
            _collect(layer, "", canonical, parts, label, type(root).__name__)
            label = f"pipeline_layers()[{i}] ({type(layer).__name__}: {', '.join(n for n, _ in parts) or 'no parameters'})"
        for name, mod in parts:  # a second name outside the listed layers would stay in the root's state dict
            for sub in mod.modules():
                others = [n for n in every[id(sub)] if not _under(n, name) and not through_slot(n)]
                if others:
                    raise ValueError(
                        f"{label}: {type(root).__name__} registers the module {canonical[id(sub)]} also as {others[0]}, "
                        "so its parameters have two names; register it once, or register the model before the "
                        "wrapper layers (the model's names are then kept)."
                    )
        described.append(Layer(i, layer, label, parts, [n for n in every.get(id(layer), []) if n != parts[0][0]]
                               if parts else every.get(id(layer), [])))
    seen: dict[int, int] = {}
    for layer in described:
        for _, mod in layer.parts:
            if seen.setdefault(id(mod), layer.index) != layer.index:
                raise ValueError(
                    f"pipeline_layers()[{seen[id(mod)]}] and pipeline_layers()[{layer.index}] hold the same module "
                    "(pipeline_layers() lists the same module twice): each module belongs to one layer; share a weight "
                    "between layers by tying parameters instead."
                )
    return described


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _collect(mod: nn.Module, path: str, canonical: dict[int, str], parts: list, label: str, root: str) -> None:
    """The top-most registered modules inside wrapper `mod`, appended to `parts` as (name in root, module)."""
    for kind, items in (("parameter", mod.named_parameters(recurse=False)), ("buffer", mod.named_buffers(recurse=False))):
        for name, _ in items:
            raise ValueError(
                f"{label} holds the {kind} `{path}{name}` that {root} does not register: register the layer (or the "
                "modules it wraps) on the LightningModule, so that stages and checkpoints can name it."
            )
    for name, child in mod.named_children():
        if id(child) in canonical:
            parts.append((canonical[id(child)], child))
        else:
            _collect(child, f"{path}{name}.", canonical, parts, label, root)


def layer_names(root: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """Name of each layer (its qualified name in `root`, or a description for a wrapper)."""
    return [layer.name for layer in describe_layers(root, layers)]


def named_parts(root: nn.Module, layers: Sequence[nn.Module]) -> dict[str, nn.Module]:
    """Qualified name in `root` -> module, for the state of every layer (what stage names list)."""
    return {name: mod for layer in describe_layers(root, layers) for name, mod in layer.parts}


def check_stage_layers(stage_layers: Sequence[int], num_layers: int | None, num_stages: int) -> list[int]:
    """`stage_layers` as a list: one positive layer count per stage, summing to `num_layers` (not
    checked while the model is unknown: None)."""
    counts = list(stage_layers) if isinstance(stage_layers, Sequence) and not isinstance(stage_layers, str) else None
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
        f"stage_layers={counts if counts is not None else stage_layers!r} must list {num_stages} positive layer counts "
        f"(one per stage: pipeline_parallel x loops){total}; {example}leave stage_layers unset (None) to "
        "balance the stages by parameter count, or set stage_layers='auto' to balance them by measured time."
    )


class StageModule(nn.Module):
    """A contiguous run of the model's layers; their state is registered under the root's qualified names.

    `named_layers`: (name in root, module) of the state to register (the layers themselves, or the modules that
    wrapper layers wrap); `calls`: the layers to run, in order (default: the registered modules). `side_inputs`:
    the module's ``pipeline_side_inputs``, computed here once per micro-batch from the micro-batch's inputs (which
    the runner passes to every stage as keyword arguments, ``INPUT_KEY*``).
    """

    def __init__(
        self,
        named_layers: Sequence[tuple[str, nn.Module]],
        index: int = 0,
        rank: int = 0,
        calls: Sequence[tuple[str, nn.Module]] | None = None,
        side_inputs: Callable[[Any], dict[str, Any]] | None = None,
        last: bool = True,
    ):
        super().__init__()
        self.index, self.rank, self.last = index, rank, last  # global stage index, pipeline rank: named in errors
        self._calls = [LayerCall(mod, name) for name, mod in (calls if calls is not None else named_layers)]
        self._side_inputs = side_inputs
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
    # Set by the strategy when FSDP computes the stage in a lower precision than its parameters ("bf16-mixed",
    # sharded): FSDP casts the stage's float inputs to it, and the side inputs computed here (rotary cos/sin,
    # masks: in the default dtype) are cast alike, as a model's own forward makes them in its hidden states' dtype.
    side_input_dtype: torch.dtype | None = None

    def compile_layers(self) -> None:
        """torch.compile each layer in place (``nn.Module.compile``: names and state-dict keys stay the model's)."""
        for call in self._calls:
            call.layer.compile()

    def forward(self, *args, **kwargs):
        side = None
        if self._side_inputs is not None and kwargs:
            side = compute_side_inputs(self._side_inputs, stage_inputs(kwargs))
            if self.side_input_dtype is not None:
                side = apply_to_collection(side, torch.Tensor, _cast_float, self.side_input_dtype)
        out = args if len(args) != 1 else args[0]
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        order = ", ".join(c.name for c in self._calls)
        for i, call in enumerate(self._calls):
            if isinstance(out, dict) and call.keywords is not None and not set(out) <= call.keywords:
                raise TypeError(
                    f"bfpp: layer {self._calls[i - 1].name if i else '(stage input)'} of stage {self.index} returned "
                    f"dict ({describe_structure(out)}): a pipeline layer must return a tensor or a tuple of tensors (its next "
                    f"layer's arguments), or a dict whose keys the next layer ({call.name}) takes as keywords "
                    f"({', '.join(sorted(set(out) - call.keywords))} it does not)."
                )
            inputs, kw = call.arguments(out, side)
            try:
                # tensors passed as separate arguments: checkpoint saves them through autograd (so the
                # saved-activation meter counts them) and re-runs layer(*inputs) in backward
                out = checkpoint(call.layer, *inputs, use_reentrant=False, context_fn=call.recompute_contexts, **kw) \
                    if recompute else call.layer(*inputs, **kw)
            except Exception as error:  # say where in the pipeline, and what came in (e.g. a new sequence length)
                keywords = f", keywords {', '.join(kw)}" if kw else ""
                error.add_note(
                    f"bfpp: in layer {call.name} of stage {self.index} (pipeline rank {self.rank}; layers "
                    f"{order}); stage input {describe(args)}, layer input {describe(inputs)}{keywords}"
                )
                raise
        if not self.last:
            check_boundary(out, f"layer {call.name}, the last of stage {self.index} (pipeline rank {self.rank}),")
        elif not _passes_between_stages(out):
            raise TypeError(
                f"bfpp: layer {call.name} of stage {self.index} returned {describe_structure(out)}: the last layer "
                "must return a tensor or a tuple of tensors (what pipeline_loss receives); return a tuple in a fixed "
                "order instead of a dict, or wrap the layer."
            )
        return out


INPUT_KEY = "bfpp_input"  # keyword arguments carrying the micro-batch's inputs to every stage


def input_kwargs(inputs: Any) -> dict[str, torch.Tensor]:
    """The pipeline inputs as keyword arguments for every stage (torch splits them into micro-batches)."""
    if isinstance(inputs, tuple):
        return {f"{INPUT_KEY}_{i}": t for i, t in enumerate(inputs)}
    return {INPUT_KEY: inputs}


def stage_inputs(kwargs: dict[str, Any]) -> Any:
    """One micro-batch's inputs from the keyword arguments of `input_kwargs`."""
    if INPUT_KEY in kwargs:
        return kwargs[INPUT_KEY]
    return tuple(kwargs[f"{INPUT_KEY}_{i}"] for i in range(len(kwargs)))


def _passes_between_stages(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value))


def describe(values: Sequence[Any]) -> str:
    """'float32[4, 16], int64[4]': dtypes and shapes of tensors (other values by type)."""
    return ", ".join(
        f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
        for v in values
    )


def _cast_float(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


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

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            where = self.__dict__.get("where", "a layer")
            raise AttributeError(
                f"layer {where} lives on another pipeline rank: `.{name}` is not on this one. Code every rank runs "
                "(configure_optimizers, callbacks) should take parameters from self.named_parameters() or a module's "
                ".parameters() (this rank's own: empty for a layer that lives elsewhere), not from a layer's attributes."
            ) from None

    def extra_repr(self) -> str:
        return self.where


def _check_not_cut(root: nn.Module) -> None:
    """Raise when an earlier bfpp run in this process has cut `root`: its other ranks' layers are placeholders."""
    remote = [m.where for m in root.modules() if isinstance(m, RemoteLayer)]
    if remote:
        raise RuntimeError(
            f"{type(root).__name__} was already cut into pipeline stages by an earlier Trainer(strategy='bfpp') in "
            f"this process: {len(remote)} of its layers (e.g. {remote[0]}) hold no weights here, they live on other "
            "ranks, so a new Trainer cannot cut it again. Reuse that Trainer (its fit/validate/test/predict keep the "
            "cut), or build a new model for the new Trainer (to continue training: trainer.fit(new_model, "
            "ckpt_path=<checkpoint>), which loads into any layout)."
        )


def _stage_groups(
    root: nn.Module, layers: Sequence[nn.Module], num_stages: int, stage_layers: Sequence[int] | None
) -> list[list[Layer]]:
    _check_not_cut(root)
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
    counts = check_stage_layers(stage_layers, len(layers), num_stages) if stage_layers else balanced_stage_layers(weights, num_stages)
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
    return [[name for layer in group for name, _ in layer.parts] for group in _stage_groups(root, layers, num_stages, stage_layers)]


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
                       calls=[(layer.name, layer.module) for layer in stages[s]], side_inputs=side, last=s == num_stages - 1)
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
