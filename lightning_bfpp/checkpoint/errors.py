"""What bfpp says when a checkpoint cannot be written or read. ``CheckpointError``: a checkpoint that cannot be loaded
as asked. ``StorageError``: an OSError of the storage under it (a full disk, a permission, a missing file), told in
one line with the errno's meaning, the path, the sizes and the setting that helps; every rank raises the same one."""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # no space left / a quota exceeded
DENIED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})  # a permission / a read-only filesystem


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as asked: missing, incomplete, corrupted, or of another model."""


class StorageError(CheckpointError):
    """Writing or reading a checkpoint failed on its storage. Every rank raises it with the same text (the failure
    is shared: torch.distributed.checkpoint gathers every rank's), so the job says it as the reason it stops rather
    than blaming the first rank that happened to raise (``job.watchdog``)."""

    job_wide = True


@dataclass(frozen=True)
class StorageNames:
    """How a storage error spells the settings that help (default: Lightning's; an app names its own keys)."""

    keep: str = "ModelCheckpoint(save_top_k=N)"  # how many checkpoints stay
    directory: str | None = None  # where they are written (None: the Lightning setting behind each folder)

    def where(self, lightning_setting: str) -> str:
        return self.directory or lightning_setting


def size_text(n: int | None) -> str:
    """Bytes as people read them: '812 B', '5.3 MiB', '1.2 GiB'; '?' when unknown."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def errno_text(error: OSError) -> str:
    """'No space left on device (ENOSPC)': the errno's meaning and its name."""
    code = error.errno
    meaning = error.strerror or (os.strerror(code) if code else type(error).__name__)
    return f"{meaning} ({errno.errorcode.get(code, code)})" if code else meaning


def save_error(path: Path, rank: int, error: OSError, *, save_bytes: int | None, free: int | None,
               last_bytes: int | None, names: StorageNames, newest: str = "") -> StorageError:
    """`error` (rank `rank`'s, while saving the checkpoint `path`) as one line: the errno's meaning, the file, this
    save's size, the free space, the setting that helps, the newest complete checkpoint (`newest`)."""
    where = error.filename or path.parent
    last = f"; the last complete save took {size_text(last_bytes)}" if last_bytes else ""
    text = (f"saving {path} failed: {errno_text(error)} on rank {rank} writing {where} (this save needs about "
            f"{size_text(save_bytes)}, {size_text(free)} free there{last})")
    elsewhere = names.where("ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...)")
    if error.errno in FULL:
        fix = (f"free space there, keep fewer checkpoints ({names.keep}) or write them to another filesystem "
               f"({elsewhere})")
    elif error.errno in DENIED:
        fix = f"make {path.parent} writable for this user, or write the checkpoints elsewhere ({elsewhere})"
    else:
        fix = f"check that filesystem, or write the checkpoints elsewhere ({elsewhere})"
    return StorageError(f"{text}. Fix: {fix}. The partial save was removed.{newest}")


def read_error(file: Path | str, error: OSError, folder: Path, newest: str = "") -> StorageError:
    """`error` while reading `file` of the checkpoint `folder`, with the fix."""
    if error.errno in DENIED:
        fix = (f"make the checkpoint readable for this user (e.g. chmod -R u+rX {folder}), or run as the user who "
               "wrote it")
    elif error.errno == errno.ENOENT:
        fix = "the checkpoint is incomplete: resume from another one"
    else:
        fix = "check that filesystem, or resume from another checkpoint"
    return StorageError(f"reading {error.filename or file} failed: {errno_text(error)}. Fix: {fix}.{newest}")


def unwritable_error(directory: Path, tried: Path, error: OSError, setting: str) -> StorageError:
    """A checkpoint directory this process cannot write to (`tried`: where, itself or the parent it would be made
    in), found before training starts."""
    where = "" if Path(tried) == Path(directory).absolute() else f" (making it in {tried})"
    return StorageError(f"checkpoints cannot be written to {directory} ({setting}): {errno_text(error)}{where}. Fix: "
                        f"make it writable for this user, or set {setting} to a directory you can write to.")
