"""Optimizer state between Lightning's plain checkpoints and bfpp's. A plain checkpoint holds torch's
``optimizer.state_dict()``: parameters by position ({"state": {i: ...}, "param_groups": [{"params": [i, ...]}]}),
numbered group after group in the order the optimizer was given them. bfpp keeps state by parameter name. The
positions are named with the optimizer's param groups as the whole model's parameter names (every rank's
stages together), each group in the model's parameter order — as `torch.optim.X(self.parameters())` and
per-group filters over `named_parameters()` build them — and checked against the saved shapes."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .safety import CheckpointError

Groups = list[list[str]]  # per param group: the whole model's parameter names, in the model's order


def canonical_names(module: nn.Module, param_order: list[str], aliases: dict[str, list[str]]) -> dict[int, str]:
    """{id(parameter): its name in the whole model's `param_order`} for this rank's parameters (a tied copy is
    named as the model names the tied weight)."""
    known = set(param_order)
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in out:
            out[id(p)] = name if name in known else next((a for a in aliases.get(name, ()) if a in known), name)
    return out


def optimizer_groups(module: nn.Module, optimizer: torch.optim.Optimizer, param_order: list[str],
                     aliases: dict[str, list[str]]) -> Groups:
    """The param groups of `optimizer` over the whole model (collective when distributed)."""
    names = canonical_names(module, param_order, aliases)
    local = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    parts: list[Any] = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
    position = {n: i for i, n in enumerate(param_order)}
    return [sorted({n for part in parts for n in part[g]}, key=lambda n: position.get(n, len(position)))
            for g in range(len(local))]


def named_state(plain: dict[str, Any], groups: Groups, shapes: dict[str, torch.Size], source: str) -> tuple[dict, list]:
    """({name: that parameter's state}, [each group's settings]) of a plain optimizer state dict."""
    saved = plain.get("param_groups", [])
    sizes = [len(g.get("params", ())) for g in saved]
    if sizes != [len(g) for g in groups]:
        raise CheckpointError(
            f"{source}: its optimizer has {len(saved)} param group(s) of {sizes} parameters; this model's optimizer "
            f"has {len(groups)} of {[len(g) for g in groups]}. Resume with the configure_optimizers it was saved "
            "with.")
    by_position = {i: n for group, names in zip(saved, groups) for i, n in zip(group["params"], names)}
    state = {by_position[i]: s for i, s in plain.get("state", {}).items()}
    for name, entries in state.items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shapes.get(name):
                raise CheckpointError(
                    f"{source}: optimizer state {key!r} of the parameter at position "
                    f"{_position(by_position, name)} has shape {tuple(value.shape)}, but that position is {name} "
                    f"{tuple(shapes.get(name, ()))} in this model: its configure_optimizers listed the parameters in "
                    "another order than the model's. Resume it under the strategy that wrote it, or export its "
                    "weights only.")
    return state, [{k: v for k, v in group.items() if k != "params"} for group in saved]


def _position(by_position: dict[int, str], name: str) -> int:
    return next(i for i, n in by_position.items() if n == name)


def local_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict, settings: list,
                     param_order: list[str], aliases: dict[str, list[str]]) -> dict[str, Any]:
    """The full (unsharded) optimizer state dict of this rank's parameters, keyed by their names here, for
    ``set_optimizer_state_dict(..., full_state_dict=True)``."""
    canonical = canonical_names(module, param_order, aliases)
    here = {id(p): n for n, p in module.named_parameters()}
    out: dict[str, Any] = {"state": {}, "param_groups": []}
    for group, setting in zip(optimizer.param_groups, settings):
        names = [here[id(p)] for p in group["params"]]
        out["param_groups"].append({**setting, "params": names})
        for p, name in zip(group["params"], names):
            if canonical[id(p)] in state:
                out["state"][name] = state[canonical[id(p)]]
    return out


def plain_state(flat: dict[str, Any], groups: Groups) -> dict[str, Any]:
    """torch's `optimizer.state_dict()` (by position) from bfpp's flattened per-name entries ('state.<name>.<key>',
    'param_groups.<name>.<setting>'; keys and settings hold no dot) of one optimizer, with `groups` as saved in the
    checkpoint's metadata."""
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    for key, value in flat.items():
        kind, rest = key.split(".", 1)
        name, leaf = rest.rsplit(".", 1)
        entries.setdefault((kind, name), {})[leaf] = value
    positions = [n for names in groups for n in names]
    state = {i: entries[("state", n)] for i, n in enumerate(positions) if ("state", n) in entries}
    param_groups, start = [], 0
    for names in groups:
        settings = entries.get(("param_groups", names[0]), {}) if names else {}
        param_groups.append({**settings, "params": list(range(start, start + len(names)))})
        start += len(names)
    return {"state": state, "param_groups": param_groups}
