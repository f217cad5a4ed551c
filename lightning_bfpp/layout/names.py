"""Name a model's pipeline layers by where the LightningModule registers their state (the names of its state
dict), so that stages keep the model's own parameter names; a wrapper layer is named by the modules it wraps."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn


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
            held = ", ".join(n for n, _ in parts) or "no parameters"
            label = f"pipeline_layers()[{i}] ({type(layer).__name__}: {held})"
        for name, mod in parts:  # a second name outside the listed layers would stay in the root's state dict
            for sub in mod.modules():
                others = [n for n in every[id(sub)] if not _under(n, name) and not through_slot(n)]
                if others:
                    raise ValueError(
                        f"{label}: {type(root).__name__} registers the module {canonical[id(sub)]} also as "
                        f"{others[0]}, so its parameters have two names; register it once, or register the model "
                        "before the wrapper layers (the model's names are then kept)."
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
    own = (("parameter", mod.named_parameters(recurse=False)), ("buffer", mod.named_buffers(recurse=False)))
    for kind, items in own:
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
