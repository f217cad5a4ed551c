"""Is this folder a complete, intact bfpp checkpoint? A manifest (manifest.json: every file's size and
sha256) is written at save and verified at load, the hashing split over the ranks; cheap structural checks
(files present and readable, shards as long as the metadata says) run before any process starts; errors name the
file, the fix and the newest complete checkpoint next to it; a folder that cannot be read is never skipped silently
when looking for the newest (``newest_to_resume``)."""
from __future__ import annotations

import hashlib
import json
import re
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from .errors import StorageError, read_error
from .safety import DCP_METADATA, CheckpointError, load_file, read_dcp_metadata

META_FILE = "meta.pt"  # Lightning's metadata file name: loops, schedulers, callbacks, epoch, step
MANIFEST = "manifest.json"
FORMAT = "lightning-bfpp checkpoint"
_CHUNK = 1 << 22


def sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _mine(names: list[str], rank: int, world: int) -> list[str]:
    """This rank's share of the files to hash: the shards DCP wrote as rank r (`__r_*.distcp`) to rank r (likely
    still in its page cache after a save), the rest round-robin."""
    out = []
    for i, name in enumerate(names):
        m = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
        if (int(m[1]) if m else i) % world == rank:
            out.append(name)
    return out


def hash_files(folder: Path, names: list[str], group: dist.ProcessGroup | None = None) -> dict[str, dict[str, Any]]:
    """{name: {"bytes", "sha256"}} for every file in `names`, each rank hashing its share (collective over `group`,
    the whole world: the default group, or a save's own). A file a rank cannot read raises CheckpointException (the
    OSError of the first such rank) on every rank."""
    rank, world = _rank_world()
    local: dict[str, Any] = {}
    try:
        for n in _mine(names, rank, world):
            local[n] = {"bytes": (folder / n).stat().st_size, "sha256": sha256(folder / n)}
    except OSError as e:
        local = {"": e}
    parts: list[Any] = [local]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, local, group=group)
    failures = {r: (part[""], traceback.StackSummary()) for r, part in enumerate(parts) if "" in part}
    if failures:
        raise CheckpointException("hash", failures)
    return {k: v for part in parts for k, v in part.items()}


def write_manifest(folder: Path, files: dict[str, dict[str, Any]], global_step: int | None,
                   name: str | None = None) -> None:
    """`name`: the folder's name once complete (a save interrupted before its rename can take it back)."""
    manifest = {"format": FORMAT, "version": 1, "global_step": global_step, "name": name,
                "files": dict(sorted(files.items()))}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def load_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest as it is (None: none), raising what reading it raised (OSError, ValueError, ...)."""
    file = folder / MANIFEST
    if not file.is_file():
        return None
    manifest = json.loads(file.read_text())
    assert manifest["format"] == FORMAT and isinstance(manifest["files"], dict)
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    file = folder / MANIFEST
    try:
        return load_manifest(folder)
    except OSError as e:
        raise read_error(file, e, folder, newest_note(folder)) from None
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{file}: not a bfpp checkpoint manifest ({type(e).__name__}: {e}); it is damaged "
                              f"or was not written by lightning-bfpp.{newest_note(folder)}") from None


def verify_checksums(folder: Path, manifest: dict[str, Any] | None) -> None:
    """Every rank raises the same error when any listed file's sha256 differs (collective when distributed)."""
    if manifest is None:
        return
    names = sorted(manifest["files"])
    try:
        got = hash_files(folder, names)
    except CheckpointException as e:
        _rank, (error, _trace) = min(e.failures.items())
        raise read_error(getattr(error, "filename", None) or folder, error, folder, newest_note(folder)) from None
    bad = [n for n in names if got[n]["sha256"] != manifest["files"][n]["sha256"]]
    if bad:
        raise CheckpointError(
            f"{folder / bad[0]}: checksum mismatch (sha256 differs from {MANIFEST}"
            + (f"; also {', '.join(bad[1:4])}" if len(bad) > 1 else "")
            + f"): the file was corrupted or modified after the save.{newest_note(folder)}"
        )


def inspect(folder: Path) -> tuple[int, float] | OSError | None:
    """(global_step, mtime) when `folder` looks like a complete bfpp checkpoint (names and sizes; no hashing); the
    OSError when it cannot be read (it may be one); None when it is not a complete checkpoint."""
    try:
        manifest = load_manifest(folder)
        if manifest is None:
            ok = (folder / META_FILE).is_file() and (folder / DCP_METADATA).is_file()
            return (-1, folder.stat().st_mtime) if ok else None
        for name, info in manifest["files"].items():
            f = folder / name
            if not f.is_file() or f.stat().st_size != info.get("bytes"):
                return None
    except OSError as e:
        return e
    except (ValueError, KeyError, TypeError, AssertionError):
        return None
    step = manifest.get("global_step")
    return (step if isinstance(step, int) else -1, folder.stat().st_mtime)


def quick_complete(folder: Path) -> tuple[int, float] | None:
    """(global_step, mtime) when `folder` looks like a complete bfpp checkpoint (names and sizes; no hashing)."""
    found = inspect(folder)
    return found if isinstance(found, tuple) else None


def _candidates(parent: Path, exclude: Path | None = None) -> list[Path]:
    return sorted(d for d in parent.iterdir() if d.is_dir() and not d.name.startswith(".") and d != exclude)


def newest_complete(parent: Path, exclude: Path | None = None) -> Path | None:
    """The newest complete checkpoint folder in `parent` (for a note in a message: folders it cannot read are passed
    over; ``newest_to_resume`` refuses them)."""
    try:
        if not parent.is_dir():
            return None
        found = [(key, d) for d in _candidates(parent, exclude) if (key := quick_complete(d)) is not None]
    except OSError:
        return None
    return max(found)[1] if found else None


def newest_to_resume(parent: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint folder in `parent` to resume from, and a line for each folder passed over as
    incomplete. A folder that cannot be read may be the newest: StorageError names it and the fix rather than resuming
    from an older one silently."""
    try:
        if not parent.is_dir():
            return None, []
        folders = _candidates(parent)
    except OSError as e:
        raise read_error(parent, e, parent) from None
    found, passed = [], []
    for d in folders:
        key = inspect(d)
        if isinstance(key, OSError):
            raise StorageError(f"{d} cannot be read ({key.strerror or key}: {key.filename or d}), and it may be "
                               f"the newest checkpoint in {parent}. Fix: make it readable for this user (e.g. chmod -R "
                               f"u+rX {d}), remove it, or resume from a checkpoint you name with ckpt_path=.")
        if key is None:
            passed.append(f"{d} is not a complete checkpoint (a file missing or shorter than its manifest says): "
                          "passed over")
        else:
            found.append((key, d))
    return (max(found)[1] if found else None), passed


def newest_note(folder: Path, parent: Path | None = None) -> str:
    """' The newest complete checkpoint in <parent>: <path>.' (or that there is none)."""
    parent = parent or folder.parent
    best = newest_complete(parent, exclude=folder)
    if best is None:
        return f" No complete checkpoint in {parent}."
    return f" The newest complete checkpoint in {parent}: {best} (resume with ckpt_path={best})."


def check_folder(folder: Path, trust: bool = False) -> tuple[Metadata, dict[str, Any], dict[str, Any] | None]:
    """Structural checks of a checkpoint folder (no hashing): the files exist, can be opened, have the sizes the
    manifest records, the shards are as long as the metadata says; `.metadata` and `meta.pt` are read safely.
    Returns (DCP metadata, Lightning meta, manifest or None). A file this process cannot read (a permission) raises
    StorageError naming it and the fix."""
    try:
        return _check_folder(folder, trust)
    except OSError as e:
        raise read_error(e.filename or folder, e, folder, newest_note(folder)) from None


def _check_folder(folder: Path, trust: bool) -> tuple[Metadata, dict[str, Any], dict[str, Any] | None]:
    for name in (DCP_METADATA, META_FILE):
        if not (folder / name).is_file():
            if not (folder / DCP_METADATA).is_file() and not (folder / META_FILE).is_file():
                inside = newest_complete(folder)
                if inside is not None:
                    raise CheckpointError(f"ckpt_path={str(folder)!r} is a folder of checkpoints, not one: pass one "
                                          f"of them, e.g. the newest complete, ckpt_path={inside}.")
                raise CheckpointError(f"ckpt_path={str(folder)!r} is not a bfpp checkpoint folder (no {DCP_METADATA}, "
                                      f"no {META_FILE}).{newest_note(folder)}")
            raise CheckpointError(f"{folder / name} is missing: {folder} is not a complete "
                                  f"checkpoint.{newest_note(folder)}")
    manifest = read_manifest(folder)
    for name, info in (manifest or {"files": {}})["files"].items():
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing (listed in {MANIFEST}): the checkpoint is "
                                  f"incomplete.{newest_note(folder)}")
        if f.stat().st_size != info.get("bytes"):
            raise CheckpointError(f"{f} has {f.stat().st_size} bytes, {MANIFEST} says {info.get('bytes')}: the file is "
                                  f"truncated or damaged.{newest_note(folder)}")
    metadata = read_dcp_metadata(folder, trust)
    extent: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if isinstance(path, str):
            extent[path] = max(extent.get(path, 0), int(info.offset) + int(info.length))
    for path, end in sorted(extent.items()):
        f = folder / path
        if not f.is_file():
            raise CheckpointError(f"{f} is missing (the checkpoint's {DCP_METADATA} lists it): the checkpoint is "
                                  f"incomplete.{newest_note(folder)}")
        if f.stat().st_size < end:
            raise CheckpointError(f"{f} has {f.stat().st_size} bytes, {DCP_METADATA} needs {end}: the shard is "
                                  f"truncated.{newest_note(folder)}")
    for name in sorted({DCP_METADATA, META_FILE, *(manifest or {"files": {}})["files"], *extent}):
        open(folder / name, "rb").close()  # readable by this process (a permission is not a damaged file)
    meta = load_file(folder / META_FILE, trust, map_location="cpu")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{folder / META_FILE} holds a {type(meta).__name__}, not Lightning's checkpoint "
                              "metadata.")
    return metadata, meta, manifest
