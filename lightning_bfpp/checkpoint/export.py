"""A bfpp checkpoint folder consolidated into one plain file (``python -m lightning_bfpp.checkpoint``)."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .loading import dcp_load
from .manifest import check_folder, newest_note, verify_checksums
from .plain import plain_state
from .safety import CheckpointError, trusted


def consolidate(checkpoint_dir: Path, trust: bool = False, full: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """(the whole state dict {name: full tensor}, the Lightning metadata) of a bfpp checkpoint folder, read in this
    process after the folder is checked and its checksums verified. `full`: the metadata holds the optimizer state
    (torch's, by position), loops, callbacks and LR schedulers too; else only epoch, global_step, hyper_parameters and
    what the module saved itself."""
    checkpoint_dir, trust = Path(checkpoint_dir), trusted(trust)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir} is not a bfpp checkpoint folder.{newest_note(checkpoint_dir)}")
    metadata, meta, manifest = check_folder(checkpoint_dir, trust)
    verify_checksums(checkpoint_dir, manifest)
    prefix = "state_dict."
    request = {k[len(prefix):]: torch.empty(tuple(v.size), dtype=v.properties.dtype)
               if isinstance(v, TensorStorageMetadata) else None
               for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    box = {"state_dict": request}
    if full:
        box.update(_optimizer_request(metadata, meta, checkpoint_dir))
    dcp_load(box, checkpoint_dir, trust)
    state_dict = box.pop("state_dict")
    if full:
        groups = meta["bfpp"]["optimizer_groups"]
        extra = {**meta, "optimizer_states": [plain_state(box[f"optimizer_{i}"], g) for i, g in enumerate(groups)]}
    else:
        extra = {k: v for k, v in meta.items() if k not in ("loops", "callbacks", "optimizer_states", "lr_schedulers")}
    return state_dict, extra


def export(checkpoint_dir: Path, out: Path, trust: bool = False, full: bool = False) -> dict[str, torch.Tensor]:
    """Consolidate a bfpp checkpoint folder into one file: {"state_dict": {name: full tensor}, plus the
    Lightning metadata (epoch, global_step, hyper_parameters)} — `Model.load_from_checkpoint(out)` and
    `model.load_state_dict(torch.load(out)["state_dict"], strict=True)` work with no process group.
    `full`: also the optimizer state (torch's, by position) and Lightning's loops, callbacks and LR schedulers — a
    plain Lightning checkpoint that `Trainer(strategy="auto")` and DDP resume with `ckpt_path=out`.
    The folder is checked and its checksums verified first; `out` is written only on success."""
    out = Path(out)
    if out.is_dir():
        raise CheckpointError(f"out={str(out)!r} is a folder: give the file to write, e.g. {out / 'model.ckpt'}.")
    if not out.parent.is_dir():
        raise CheckpointError(f"out={str(out)!r}: the folder {out.parent} does not exist; create it first.")
    state_dict, extra = consolidate(checkpoint_dir, trust, full)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        torch.save({**extra, "state_dict": state_dict}, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return state_dict


def _optimizer_request(metadata, meta: dict, folder: Path) -> dict[str, dict]:
    """{"optimizer_<i>": {flattened key: an empty tensor of the saved shape, or None for a setting}} for dcp_load."""
    groups = meta.get("bfpp", {}).get("optimizer_groups")
    if groups is None:
        raise CheckpointError(f"{folder} does not record its optimizer's param groups (written by lightning-bfpp "
                              "before `export --full`): export its weights only (without --full).")
    request: dict[str, dict] = {f"optimizer_{i}": {} for i in range(len(groups))}
    for key, value in metadata.state_dict_metadata.items():
        head, _, rest = key.partition(".")
        if head in request:
            request[head][rest] = torch.empty(tuple(value.size), dtype=value.properties.dtype) \
                if isinstance(value, TensorStorageMetadata) else None
    return request
