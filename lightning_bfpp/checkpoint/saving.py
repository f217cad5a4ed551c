"""Saving a sharded checkpoint folder: torch.distributed.checkpoint's shards of every rank, rank 0's Lightning
metadata and a manifest of checksums; the folder takes its name only once complete (an interrupted save leaves a
hidden ``.tmp-*`` folder), in the calling thread or in the background (``background``)."""
from __future__ import annotations

import io
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from .background import BackgroundSaves
from .manifest import META_FILE, hash_files, remove_stale_tmp, write_manifest
from .plain import optimizer_groups
from .safety import TRUST_ENV
from .state import rng_state, this_rank


def save_trainer_checkpoint(path: Path, checkpoint: dict[str, Any], model: torch.nn.Module, optimizers: list,
                            layout: dict[str, Any], param_order: list[str], aliases: dict[str, list[str]],
                            background: BackgroundSaves | None = None) -> None:
    """Lightning's `checkpoint` dict as a sharded folder (`save`): its model and optimizer states as this rank's
    shards; the rest (loops, callbacks, hyperparameters) as metadata, with the `layout` it was written in and each
    optimizer's param groups by the whole model's names (`export --full` numbers them as torch does)."""
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    groups = [optimizer_groups(model, o, param_order, aliases) for o in optimizers]
    checkpoint["bfpp"] = {**layout, "optimizer_groups": groups}
    save(path, state, checkpoint, background)


def save(path: Path, state: dict[str, Any], meta: dict[str, Any], background: BackgroundSaves | None = None) -> None:
    """Write `state` (tensors, sharded or not) with torch.distributed.checkpoint on all ranks, plus rank 0's
    `meta` and a manifest of every file's size and sha256 (hashing split over the ranks). The folder appears
    under `path` only once complete: an interrupted save leaves a hidden `.tmp-*` folder that is never taken
    for a checkpoint, and is removed by a later successful save in the same directory. With `background`, the
    state is copied to CPU memory here and everything else happens in a background thread (``background``)."""
    path = Path(path)
    token = [uuid.uuid4().hex if this_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    # no "ckpt_" in a hidden name: Lightning reads the version of every name holding "hpc_ckpt_" / "ckpt_" in
    # default_root_dir (hpc_ckpt_<N>.ckpt) from all its digits, the token's too
    hidden = f".{path.name.replace('_', '-')}.tmp-{token[0][:8]}"
    tmp = path.parent / hidden
    meta_bytes = io.BytesIO()
    torch.save(meta, meta_bytes)  # as it is now (a background save writes it later)
    state = {**state, "rng": rng_state()}
    if background is None:
        dcp.save(state, checkpoint_id=tmp)
        _finish(path, tmp, meta_bytes.getvalue(), meta.get("global_step"), None)
    else:
        background.start(lambda group: dcp.async_save(state, checkpoint_id=tmp, process_group=group),
                         lambda group: _finish(path, tmp, meta_bytes.getvalue(), meta.get("global_step"), group))


def _finish(path: Path, tmp: Path, meta: bytes, global_step: int | None, group: dist.ProcessGroup | None) -> None:
    """After the shards are written: rank 0's meta.pt, the manifest (hashing split over the ranks of `group`), then
    the folder takes its name."""
    names: list[Any] = [None]
    if this_rank() == 0:
        (tmp / META_FILE).write_bytes(meta)
        _warn_unsafe_meta(tmp / META_FILE)
        names = [sorted(p.name for p in tmp.iterdir() if p.is_file())]
    if dist.is_initialized():
        dist.broadcast_object_list(names, src=0, group=group)
    files = hash_files(tmp, names[0], group)
    if this_rank() == 0:
        write_manifest(tmp, files, global_step)
        # the old checkpoint steps aside (a rename) before the new one takes its name, and is deleted only then:
        # a kill at any moment leaves a complete checkpoint, never a half-deleted one
        old = tmp.with_name(f"{tmp.name}-replaced")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
        for stale in remove_stale_tmp(path.parent):
            rank_zero_info(f"removed {stale}: an interrupted save's partial checkpoint")
    if dist.is_initialized():
        dist.barrier(group=group)


def _warn_unsafe_meta(file: Path) -> None:
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    if unsafe:
        rank_zero_warn(f"{file.parent.name}/{META_FILE} holds types {unsafe[:5]} (hyper-parameters or callback state) "
                       "that loading refuses by default (they could run code); register them with "
                       "torch.serialization.add_safe_globals([...]) before resuming, or resume with "
                       f"BFPPStrategy(trust_checkpoints=True) / {TRUST_ENV}=1.")
