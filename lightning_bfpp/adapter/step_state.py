"""What the user's own step (validation_step, test_step, predict_step, pipeline_train_metrics) changes
in the LightningModule's plain attributes, carried from the last stage's ranks, where the step runs, to the
other pipeline ranks, so hooks that run on every rank (on_validation_epoch_end aggregating the outputs the
steps appended, a counter the steps advanced, a tracker a callback reads) see what they would see without
a pipeline."""
from __future__ import annotations

import hashlib
import pickle
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

FINGERPRINT_LIMIT = 8 << 20  # attributes that pickle larger are compared by identity only (rebinding is seen)
_LIGHTNING_OWN = ("training", "prepare_data_per_node", "allow_zero_length_dataloader_with_multiple_devices")
_warned: set[str] = set()


@dataclass
class StateChange:
    """One attribute's change: `kind` "set" (rebound, new, or changed inside: `value` is the whole new value),
    "extend" (a list grew: `value` the new items), "extend_key" (a dict's list grew: `value` = (key, new items))
    or "set_key" (a dict's list appeared or was replaced: `value` = (key, items))."""

    attribute: str
    kind: str
    value: Any


@dataclass
class _Seen:
    value: Any  # the object itself: kept alive, so identity comparisons are sound
    how: str  # "list" | "dict_of_lists" | "fingerprint"
    data: Any  # the list's length | {key: (list, length)} | a digest (None: identity only)


def _user_attributes(module: nn.Module) -> dict[str, Any]:
    """The module's public plain attributes (parameters, buffers and submodules live elsewhere)."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k not in _LIGHTNING_OWN}


def _flat_list(value: Any) -> bool:
    """A list of items that are not lists themselves: followed by what is appended (inner lists are not)."""
    return isinstance(value, list) and not any(isinstance(v, list) for v in value)


def _fingerprint(name: str, value: Any) -> bytes | None:
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None
    if len(data) > FINGERPRINT_LIMIT:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"bfpp: self.{name} pickles to {len(data) >> 20} MiB: changes a step makes inside it stay "
                          f"on the last stage's ranks (rebinding self.{name} is carried to every rank).", stacklevel=1)
        return None
    return hashlib.blake2b(data, digest_size=16).digest()


def _see(name: str, value: Any) -> _Seen:
    if _flat_list(value):
        return _Seen(value, "list", len(value))
    if isinstance(value, dict) and all(_flat_list(v) for v in value.values()):
        return _Seen(value, "dict_of_lists", {k: (v, len(v)) for k, v in value.items()})
    return _Seen(value, "fingerprint", _fingerprint(name, value))


def snapshot(module: nn.Module) -> dict[str, _Seen]:
    return {k: _see(k, v) for k, v in _user_attributes(module).items()}


def _dict_changes(name: str, value: dict, lists: dict[Any, tuple[list, int]]) -> list[StateChange] | None:
    """The dict's lists that grew or appeared, or None when it changed otherwise (carried whole)."""
    if set(lists) - set(value) or not all(_flat_list(v) for v in value.values()):
        return None
    found = []
    for key, items in value.items():
        old, old_len = lists.get(key, (None, 0))
        if old is not items:
            found.append(StateChange(name, "set_key", (key, items)))
        elif len(items) > old_len:
            found.append(StateChange(name, "extend_key", (key, items[old_len:])))
        elif len(items) < old_len:
            return None
    return found


def changes(module: nn.Module, before: dict[str, _Seen]) -> list[StateChange]:
    """What the step rebound or created, appended to a list or to a dict's lists (followed item by item), or
    changed inside any other attribute (by a pickled fingerprint: carried whole)."""
    found = []
    for name, value in _user_attributes(module).items():
        seen = before.get(name)
        if seen is None or seen.value is not value:
            found.append(StateChange(name, "set", value))
        elif seen.how == "list":
            if not _flat_list(value) or len(value) < seen.data:
                found.append(StateChange(name, "set", value))
            elif len(value) > seen.data:
                found.append(StateChange(name, "extend", value[seen.data:]))
        elif seen.how == "dict_of_lists":
            keyed = _dict_changes(name, value, seen.data)
            found += [StateChange(name, "set", value)] if keyed is None else keyed
        elif seen.data is not None and _fingerprint(name, value) != seen.data:
            found.append(StateChange(name, "set", value))
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
