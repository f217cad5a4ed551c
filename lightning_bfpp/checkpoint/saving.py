"""Saving a sharded checkpoint folder: torch.distributed.checkpoint's shards of every rank, rank 0's Lightning
metadata and a manifest of checksums; the folder takes its name only once complete (it is written as a hidden
``.tmp-*`` folder), in the calling thread or in the background (``background``). A save that fails removes its
hidden folder on every rank and raises the same ``StorageError`` on every rank (``errors``: the errno's meaning, the
file, the sizes, the setting that helps); a save whose free space is below two saves warns once (``storage``)."""
from __future__ import annotations

import io
import shutil
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException

from . import storage as disk
from .background import BackgroundSaves, raising_as_told
from .errors import save_error, size_text
from .manifest import META_FILE, hash_files, newest_note, write_manifest
from .partial import clean_partial_saves
from .plain import optimizer_groups
from .safety import TRUST_ENV
from .state import rng_state, this_rank


def save_trainer_checkpoint(path: Path, checkpoint: dict[str, Any], model: torch.nn.Module, optimizers: list,
                            layout: dict[str, Any], param_order: list[str], aliases: dict[str, list[str]],
                            background: BackgroundSaves | None = None, storage: disk.Storage | None = None) -> None:
    """Lightning's `checkpoint` dict as a sharded folder (`save`): its model and optimizer states as this rank's
    shards; the rest (loops, callbacks, hyperparameters) as metadata, with the `layout` it was written in and each
    optimizer's param groups by the whole model's names (`export --full` numbers them as torch does)."""
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    groups = [optimizer_groups(model, o, param_order, aliases) for o in optimizers]
    checkpoint["bfpp"] = {**layout, "optimizer_groups": groups}
    save(path, state, checkpoint, background, storage)


def save(path: Path, state: dict[str, Any], meta: dict[str, Any], background: BackgroundSaves | None = None,
         storage: disk.Storage | None = None) -> None:
    """Write `state` (tensors, sharded or not) with torch.distributed.checkpoint on all ranks, plus rank 0's
    `meta` and a manifest of every file's size and sha256 (hashing split over the ranks). The folder appears
    under `path` only once complete: until then it is a hidden `.tmp-*` folder, never taken for a checkpoint,
    removed on every rank when the save fails (an interrupted process leaves it: a later successful save in the same
    directory removes it). With `background`, the state is copied to CPU memory here and everything else happens
    in a background thread (``background``). `storage`: the run's record of its saves (``storage.Storage``)."""
    path, storage = Path(path), storage if storage is not None else disk.Storage()
    if background is not None:
        background.wait()  # one save at a time; the last one's size is known once it is complete
    token, estimate, free = _survey(path, state)
    _warn_low_space(path, free, storage)
    # no "ckpt_" in a hidden name: Lightning reads the version of every name holding "hpc_ckpt_" / "ckpt_" in
    # default_root_dir (hpc_ckpt_<N>.ckpt) from all its digits, the token's too
    tmp = path.parent / f".{path.name.replace('_', '-')}.tmp-{token[:8]}"
    meta_bytes = io.BytesIO()
    torch.save(meta, meta_bytes)  # as it is now (a background save writes it later)
    state = {**state, "rng": rng_state()}

    def failed(error: BaseException) -> BaseException:
        return _failure(error, path, tmp, estimate, storage)

    def finish(group: dist.ProcessGroup | None) -> None:
        _finish(path, tmp, meta_bytes.getvalue(), meta.get("global_step"), group, storage)

    if background is None:
        with raising_as_told(failed):
            dcp.save(state, storage_writer=disk.CheckpointWriter(tmp))
            finish(None)
    else:
        background.start(lambda group: dcp.async_save(state, storage_writer=disk.CheckpointWriter(tmp),
                                                      process_group=group), finish, failed)


def _survey(path: Path, state: dict[str, Any]) -> tuple[str, int, int | None]:
    """(this save's name token, rank 0's; about how many bytes it writes over all ranks; the least free space any
    rank sees where it goes): one gather of every rank's share."""
    sharded, whole = disk.state_bytes(state)
    mine = (uuid.uuid4().hex if this_rank() == 0 else None, sharded, whole, disk.free_bytes(path.parent))
    every = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    whole_keys = {k: v for _, _, w, _ in every for k, v in w.items()}
    free = [f for *_, f in every if f is not None]
    return every[0][0], sum(s for _, s, _, _ in every) + sum(whole_keys.values()), min(free, default=None)


def _warn_low_space(path: Path, free: int | None, storage: disk.Storage) -> None:
    """Once per run: the space left where `path` goes is below two saves of the last one's size."""
    last = storage.last_bytes
    if storage.warned or not last or free is None or free >= disk.LOW_SPACE_SAVES * last:
        return
    storage.warned = True
    names = storage.names
    rank_zero_warn(f"only {size_text(free)} free in {path.parent}, less than {disk.LOW_SPACE_SAVES} saves of "
                   f"{size_text(last)} (the last one): a save will soon fail for want of space. Free space there, keep "
                   f"fewer checkpoints ({names.keep}) or write them to another filesystem "
                   f"({names.where('ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...)')}).")


def _failure(error: BaseException, path: Path, tmp: Path, estimate: int, storage: disk.Storage) -> BaseException:
    """After a failed save (on every rank, as its failure is shared): its hidden folder removed, and the error to raise:
    a StorageError when an OSError (or a full disk) is behind it, else `error` itself."""
    found = disk.kept_os_error(error)
    free_at_failure = disk.free_bytes(path.parent)
    disk.remove_quietly(tmp)
    if found is None:
        hidden = disk.full_disk(free_at_failure, tmp) if isinstance(error, CheckpointException) else None
        if hidden is None:
            return error
        found = (None, hidden)
    rank, os_error = found
    return save_error(path, this_rank() if rank is None else rank, os_error, save_bytes=storage.last_bytes or estimate,
                      free=disk.free_bytes(path.parent), last_bytes=storage.last_bytes, names=storage.names,
                      newest=newest_note(tmp))


def _finish(path: Path, tmp: Path, meta: bytes, global_step: int | None, group: dist.ProcessGroup | None,
            storage: disk.Storage) -> None:
    """After the shards are written: rank 0's meta.pt, the manifest (hashing split over the ranks of `group`), then
    the folder takes its name. A failure on any rank is raised on every rank."""
    names = _on_rank_zero(lambda: _write_meta(tmp, meta), group, "meta")
    files = hash_files(tmp, names, group)
    _on_rank_zero(lambda: _publish(path, tmp, files, global_step), group, "publish")
    storage.last_bytes = sum(info["bytes"] for info in files.values())


def _on_rank_zero(work: Callable[[], Any], group: dist.ProcessGroup | None, step: str) -> Any:
    """`work()` on rank 0, its result on every rank; its error raised on every rank as torch.distributed.checkpoint
    raises a rank's failure (CheckpointException)."""
    box: list[Any] = [(None, None)]
    if this_rank() == 0:
        try:
            box = [(work(), None)]
        except Exception as e:  # an OSError travels as it is (errno, path); anything else as its text
            box = [(None, e if isinstance(e, OSError) else RuntimeError(f"{type(e).__name__}: {e}"))]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0, group=group)
    result, error = box[0]
    if error is not None:
        raise CheckpointException(step, {0: (error, traceback.StackSummary())})
    return result


def _write_meta(tmp: Path, meta: bytes) -> list[str]:
    (tmp / META_FILE).write_bytes(meta)
    _warn_unsafe_meta(tmp / META_FILE)
    return sorted(p.name for p in tmp.iterdir() if p.is_file())


def _publish(path: Path, tmp: Path, files: dict[str, dict[str, Any]], global_step: int | None) -> None:
    """The manifest, then the folder takes its name. The old checkpoint steps aside (a rename) before the new one
    takes its name, and is deleted only then: a kill at any moment leaves a complete checkpoint, never a half-deleted
    one; a failed rename puts the old one back."""
    write_manifest(tmp, files, global_step, path.name)
    old = tmp.with_name(f"{tmp.name}-replaced")
    if path.exists():
        path.rename(old)
    try:
        tmp.rename(path)
    except OSError:
        if old.exists() and not path.exists():
            old.rename(path)
        raise
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()
    for line in clean_partial_saves(path.parent):
        if not line.startswith("left "):  # said by the app at its start; not again at every save
            rank_zero_info(line)


def _warn_unsafe_meta(file: Path) -> None:
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    if unsafe:
        rank_zero_warn(f"{file.parent.name}/{META_FILE} holds types {unsafe[:5]} (hyper-parameters or callback state) "
                       "that loading refuses by default (they could run code); register them with "
                       "torch.serialization.add_safe_globals([...]) before resuming, or resume with "
                       f"BFPPStrategy(trust_checkpoints=True) / {TRUST_ENV}=1.")
