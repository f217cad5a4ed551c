"""Partial saves: the hidden ``.NAME.tmp-*`` folder a save writes before it takes its name. A failed save removes
its own on every rank (``saving``); a process killed mid-save leaves one behind. ``clean_partial_saves`` removes
those: never a complete checkpoint (one whose rename was interrupted takes its name back, or stays), and, unless the
caller knows that no other process writes there (the app's run-directory lock), never one written to recently."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from .errors import size_text
from .manifest import load_manifest, quick_complete

QUIET_S = 300.0  # a hidden .tmp-* folder untouched this long is an interrupted save's (not one under way)
REPLACED = "-replaced"  # the previous checkpoint, stepped aside while a new one of its name takes it


def _last_written(folder: Path) -> float:
    return max([folder.stat().st_mtime] + [f.stat().st_mtime for f in folder.iterdir()])


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _target(folder: Path) -> Path | None:
    """The name a complete hidden folder was saved for (its manifest's), in the same directory."""
    try:
        name = (load_manifest(folder) or {}).get("name")
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return None
    return folder.parent / name if isinstance(name, str) and name and "/" not in name else None


def clean_partial_saves(parent: Path, quiet_s: float = QUIET_S) -> list[str]:
    """Handle the hidden folders of interrupted saves in `parent` that nothing wrote to for `quiet_s` seconds; returns
    a line for the log per folder: an incomplete one is removed; a complete one whose name is free takes it; the
    previous checkpoint of a name whose new save completed is removed; any other complete one stays."""
    lines, now = [], time.time()
    folders = [d for d in Path(parent).glob(".*.tmp-*") if d.is_dir()]
    for d in sorted(folders, key=lambda d: (d.name.endswith(REPLACED), d.name)):  # new saves before replaced ones
        try:
            if now - _last_written(d) < quiet_s:
                continue
            size = _bytes(d)
            if quick_complete(d) is None:
                shutil.rmtree(d)
                lines.append(f"removed {d} ({size_text(size)}): the partial checkpoint of an interrupted save")
                continue
            target = _target(d)
            if target is not None and not target.exists():
                d.rename(target)
                lines.append(f"restored {target}: a complete checkpoint whose save was interrupted before it took "
                             "its name")
            elif target is not None and d.name.endswith(REPLACED) and quick_complete(target) is not None:
                shutil.rmtree(d)
                lines.append(f"removed {d} ({size_text(size)}): the previous {target.name}, replaced by a complete "
                             "save whose clean-up was interrupted")
            else:
                lines.append(f"left {d}: a complete checkpoint that did not take its name (rename it to use it)")
        except OSError as e:  # another process removed it meanwhile, or it cannot be read: left as it is
            lines.append(f"left {d}: {e}")
    return lines
