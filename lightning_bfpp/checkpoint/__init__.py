"""Checkpoints: sharded folders (torch.distributed.checkpoint) keyed by the model's own parameter names, so one
written with any (pp, loops, dp, tp) loads into any other layout (``sharded``); atomic saves with a checksum
manifest (``manifest``); loading that never runs code from the files (``safety``); export to one plain file
(``export``, ``python -m lightning_bfpp.checkpoint``).

May import: ``_private``.
"""

from .background import BackgroundSaves
from .export import export, main
from .manifest import MANIFEST, META_FILE
from .plain import optimizer_groups
from .safety import TRUST_ENV, CheckpointError, UnsafeCheckpointError
from .sharded import check_path, is_sharded, load, optimizer_state, read_meta, save

__all__ = ["BackgroundSaves", "CheckpointError", "UnsafeCheckpointError", "TRUST_ENV", "MANIFEST", "META_FILE", "check_path", "export",
           "is_sharded", "load", "main", "optimizer_groups", "optimizer_state", "read_meta", "save"]
