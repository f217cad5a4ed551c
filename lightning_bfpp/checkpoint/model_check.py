"""Whether a checkpoint fits the model it loads into: its parameter names and shapes compared with the whole
model's (every rank's stages together), a difference named in the error, or with ``strict=False`` the matching
weights picked."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .safety import CheckpointError

Shapes = dict[str, "tuple[int, ...] | None"]


def saved_shapes(metadata: Metadata) -> Shapes:
    """Names and shapes of the weights a sharded checkpoint holds (its metadata; None for a non-tensor)."""
    prefix = "state_dict."
    return {k[len(prefix):]: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None
            for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}


def tensor_shapes(state: dict[str, Any]) -> Shapes:
    """Names and shapes of a state dict's entries (None for a non-tensor)."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def _model_shapes(local: dict[str, Any]) -> Shapes:
    """Names and global shapes of the whole model: every rank's local stages together (collective)."""
    shapes = tensor_shapes(local)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return shapes
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, shapes)
    return {k: v for part in parts for k, v in part.items()}


def _differences(saved: Shapes, model: Shapes, aliases: dict[str, list[str]]) -> tuple[list, list, list]:
    """(missing in the checkpoint, not in the model, [(name, saved shape, model shape)]); a tied weight matches
    under any of its names."""
    def present(name: str, pool: Shapes) -> bool:
        return name in pool or any(a in pool for a in aliases.get(name, ()))

    missing = [n for n in model if not present(n, saved)]
    unexpected = [n for n in saved if not present(n, model)]
    mismatched = [(n, saved[n], model[n]) for n in model if n in saved and saved[n] != model[n]]
    return missing, unexpected, mismatched


def _few(names: list, n: int = 3) -> str:
    return ", ".join(map(str, names[:n])) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def _describe(source: Path, missing: list, unexpected: list, mismatched: list) -> str:
    parts = []
    if missing:
        parts.append(f"missing in the checkpoint: {_few(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in this model: {_few(unexpected)}")
    if mismatched:
        parts.append("different shapes: " + _few([f"{n} {a} in the checkpoint vs {b} here" for n, a, b in mismatched]))
    return (f"{source} was saved from a different model: " + "; ".join(parts) + ". Use the model settings it was "
            "saved with, or set `strict_loading = False` on the LightningModule to load only the weights whose names "
            "and shapes match (the optimizer state is then not restored).")


def check_model(source: Path, saved: Shapes, local: dict[str, Any], strict: bool,
                aliases: dict[str, list[str]]) -> set[str] | None:
    """None when the checkpoint and the model match; otherwise (strict=False) the local names to load."""
    missing, unexpected, mismatched = _differences(saved, _model_shapes(local), aliases)
    if not (missing or unexpected or mismatched):
        return None
    message = _describe(source, missing, unexpected, mismatched)
    if strict:
        raise CheckpointError(message)
    rank_zero_warn(f"strict_loading=False: {message.split('. Use the model settings')[0]}; loading the "
                   f"matching weights only, without optimizer state.")
    local_shapes = tensor_shapes(local)
    return {k for k in local if k in saved and saved[k] == local_shapes[k]}
