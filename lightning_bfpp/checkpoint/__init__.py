"""Checkpoints: sharded folders (torch.distributed.checkpoint) keyed by the model's own parameter names, so one
written with any (pp, loops, dp, tp) loads into any other layout: ``saving`` writes them (atomic, also in the
``background``), ``loading`` reads them (and plain files) and checks a path before launch, ``model_check`` compares a
checkpoint's names and shapes with the model's, ``state`` is the per-rank optimizer and RNG state, ``plain`` torch's
optimizer state by position; a checksum manifest (``manifest``); loading that never runs code from the files
(``safety``); export to one plain file (``export``) or a Hugging Face directory (``hf_dir``), the command
``python -m lightning_bfpp.checkpoint`` (``cli``). The storage under them
(``storage``: its errors kept, free space, writable folders), what a failure says (``errors``), and the partial
folders of interrupted saves (``partial``). The strategy's own checkpoint hooks are the mixin ``strategy_hooks``.

May import: ``_private``.
"""

from .background import BackgroundSaves
from .cli import main
from .errors import StorageError, StorageNames
from .export import export
from .loading import check_path, is_sharded, load, read_meta
from .manifest import MANIFEST, META_FILE, newest_to_resume
from .partial import clean_partial_saves
from .plain import optimizer_groups
from .safety import TRUST_ENV, CheckpointError, UnsafeCheckpointError
from .saving import save, save_trainer_checkpoint
from .state import optimizer_state
from .storage import Storage, check_save_dirs

__all__ = ["BackgroundSaves", "CheckpointError", "UnsafeCheckpointError", "StorageError", "StorageNames", "Storage",
           "TRUST_ENV", "MANIFEST", "META_FILE", "check_path", "check_save_dirs", "clean_partial_saves", "export",
           "is_sharded", "load", "main", "newest_to_resume", "optimizer_groups", "optimizer_state", "read_meta",
           "save", "save_trainer_checkpoint"]
