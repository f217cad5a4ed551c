# Scope: what the user's own step (validation_step, test_step, predict_step, pipeline_train_metrics) changes
# in the LightningModule's plain attributes, carried from the last stage's ranks, where the step runs, to the
# other pipeline ranks, so hooks that run on every rank (on_validation_epoch_end aggregating the outputs the
# steps appended, a counter the steps advanced) see what they would see without a pipeline.
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

Snapshot = dict[str, tuple[Any, Any]]  # attribute -> (the object itself, kept alive to compare by identity; its shape)


@dataclass
class StateChange:
    """One attribute's change: `kind` "set" (rebound or new: `value` is the new object), "extend" (a list
    grew: `value` the new items), "extend_key" (a dict's list grew: `value` = (key, new items)) or "set_key"
    (a dict's list appeared or was replaced: `value` = (key, items))."""

    attribute: str
    kind: str
    value: Any


def _user_attributes(module: nn.Module) -> dict[str, Any]:
    """The module's public plain attributes (parameters, buffers and submodules live elsewhere)."""
    lightning_own = ("training", "prepare_data_per_node", "allow_zero_length_dataloader_with_multiple_devices")
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k not in lightning_own}


def _shape(value: Any) -> Any:
    """What is compared after the step: a list's length, a dict's list lengths (by key)."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, dict):
        return {k: (v, len(v)) for k, v in value.items() if isinstance(v, list)}
    return None


def snapshot(module: nn.Module) -> Snapshot:
    return {k: (v, _shape(v)) for k, v in _user_attributes(module).items()}


def changes(module: nn.Module, before: Snapshot) -> list[StateChange]:
    """The attributes the step rebound or created, the lists it appended to (also a dict's lists, by key)."""
    found = []
    for name, value in _user_attributes(module).items():
        if name not in before or before[name][0] is not value:
            found.append(StateChange(name, "set", value))
        elif isinstance(value, list) and len(value) > before[name][1]:
            found.append(StateChange(name, "extend", value[before[name][1]:]))
        elif isinstance(value, dict):
            lists = before[name][1]
            for key, items in value.items():
                if not isinstance(items, list):
                    continue
                old, old_len = lists.get(key, (None, 0))
                if old is not items:
                    found.append(StateChange(name, "set_key", (key, items)))
                elif len(items) > old_len:
                    found.append(StateChange(name, "extend_key", (key, items[old_len:])))
    return found


def apply(module: nn.Module, found: list[StateChange]) -> None:
    """Make the same changes here (values already on this rank's device)."""
    for change in found:
        if change.kind == "set":
            setattr(module, change.attribute, change.value)
        elif change.kind == "extend":
            getattr(module, change.attribute).extend(change.value)
        elif change.kind == "extend_key":
            key, items = change.value
            getattr(module, change.attribute)[key].extend(items)
        else:
            key, items = change.value
            getattr(module, change.attribute)[key] = list(items)
