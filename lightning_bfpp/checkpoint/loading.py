"""Loading a checkpoint into the local stages of any layout: a sharded folder (checked, checksums verified, read
without running code) or a plain full file; and the checks that run before any process starts."""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from . import plain
from .manifest import META_FILE, check_folder, newest_note, verify_checksums
from .model_check import check_model, saved_shapes, tensor_shapes
from .safety import CheckpointError, SafePlanner, SafeReader, load_file, trusted
from .state import MODEL_OPTIONS, OPTIM_OPTIONS, optimizer_state, rng_state

LIGHTNING_PATHS = ("last", "best", "hpc")  # resolved by Lightning itself, after launch
SCHEDULER_SETTINGS = {"initial_lr"}  # what torch's LR schedulers add to param groups: kept quietly when not saved


def is_sharded(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def read_meta(path: str | os.PathLike, trust: bool = False) -> dict[str, Any]:
    """Lightning's metadata of a checkpoint (a folder's meta.pt, or a plain file), read without running code."""
    path = Path(path)
    folder = path.is_dir()
    meta = load_file(path / META_FILE if folder else path, trusted(trust), map_location="cpu", mmap=not folder)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: holds a {type(meta).__name__}, not Lightning's checkpoint metadata.")
    return meta


def check_path(ckpt_path: str | os.PathLike | None, trust: bool = False) -> None:
    """Fail before any process starts when `ckpt_path` is not a loadable checkpoint: missing, not a checkpoint,
    incomplete (files missing or shorter than recorded), or holding anything but plain data and tensors.
    Checksums are verified later, by all ranks together, when the checkpoint loads."""
    if ckpt_path is None or str(ckpt_path) in LIGHTNING_PATHS or str(ckpt_path).startswith("registry"):
        return
    path, trust = Path(ckpt_path), trusted(trust)
    if path.is_dir():
        check_folder(path, trust)
    elif path.is_file():
        _read_full_file(path, trust)
    else:
        raise CheckpointError(f"ckpt_path={str(ckpt_path)!r} does not exist.{newest_note(path)}")


def dcp_load(state: dict[str, Any], path: Path, trust: bool) -> None:
    """dcp.load through the safe reader and planner; a failure on any rank is raised on every rank by name."""
    try:
        with warnings.catch_warnings():  # one process (export): torch warns that it assumes so, on every call
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(path, trust), planner=SafePlanner(trust),
                     no_dist=not dist.is_initialized())
    except CheckpointException as e:
        failures = [exc for _, (exc, _tb) in sorted(e.failures.items())]
        ours = [exc for exc in failures if isinstance(exc, CheckpointError)]
        if ours:
            raise type(ours[0])(str(ours[0])) from None
        raise CheckpointError(f"{path}: loading failed on rank(s) {sorted(e.failures)}: "
                              f"{type(failures[0]).__name__}: {failures[0]}") from e


def load(
    path: Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool = True,
    aliases: dict[str, list[str]] | None = None,
    trust: bool = False,
    param_order: list[str] | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint (any layout) or a single full file into the local stages; return metadata.

    Every rank checks the folder (files present and complete, read without running code), verifies its share
    of the checksums, and compares the checkpoint's parameter names and shapes with the whole model's: a
    difference fails unless `strict` is False (then the matching weights load, the optimizer state does not).
    `aliases`: other names of a shared (tied) weight. A layout with one copy saves its optimizer state under
    one name only; a layout with a copy per stage reads each copy's state from whichever name was saved.
    `param_order`: the whole model's parameter names in its order, to name a plain checkpoint's optimizer state."""
    path, trust, aliases = Path(path), trusted(trust), aliases or {}
    if path.is_file():
        return _load_full_file(path, module, strict, aliases, optimizers, trust, param_order)
    if not path.exists():
        raise CheckpointError(f"ckpt_path={str(path)!r} does not exist.{newest_note(path)}")
    metadata, meta, manifest = check_folder(path, trust)
    verify_checksums(path, manifest)
    saved = set(metadata.state_dict_metadata)
    local = get_model_state_dict(module, options=MODEL_OPTIONS)
    partial = check_model(path, saved_shapes(metadata), local, strict, aliases)
    model_state = {"state_dict": local if partial is None else {k: v for k, v in local.items() if k in partial}}
    dcp_load(model_state, path, trust)
    set_model_state_dict(module, model_state["state_dict"], options=StateDictOptions(strict=strict and partial is None))
    for i, opt in enumerate(optimizers if partial is None else []):
        wanted = optimizer_state(module, opt)
        renamed = _saved_names(wanted, f"optimizer_{i}", saved, aliases)
        # param-group settings the checkpoint lacks (e.g. `initial_lr`, which an LR scheduler made after the save
        # adds, as Lightning's lr_find does) keep their current values; missing optimizer *state* still fails
        kept = {k: v for k, v in wanted.items()
                if k.startswith("param_groups.") and f"optimizer_{i}.{renamed.get(k, k)}" not in saved}
        request = {f"optimizer_{i}": {renamed.get(k, k): v for k, v in wanted.items() if k not in kept}}
        dcp_load(request, path, trust)
        back = {v: k for k, v in renamed.items()}
        loaded = {back.get(k, k): v for k, v in request[f"optimizer_{i}"].items()} | kept
        settings = sorted({k.rsplit(".", 1)[-1] for k in kept} - SCHEDULER_SETTINGS)
        if settings:
            rank_zero_warn(f"{path}: optimizer_{i}'s param groups have {', '.join(settings)}, which the checkpoint "
                           "does not: their current values are kept.")
        set_optimizer_state_dict(module, opt, loaded, options=OPTIM_OPTIONS)
    _restore_rng(path, saved, trust)
    return meta


def _saved_names(wanted: dict[str, Any], prefix: str, saved: set[str], aliases: dict[str, list[str]]) -> dict[str, str]:
    """{flattened optimizer key: the key to read instead} for keys of a tied weight saved under another name
    (flattened keys look like 'state.<parameter name>.exp_avg' and 'param_groups.<parameter name>.lr')."""
    renamed = {}
    for key in wanted:
        if f"{prefix}.{key}" in saved:
            continue
        kind, _, rest = key.partition(".")
        for name, others in aliases.items():
            if rest.startswith(name + "."):
                for other in others:
                    alt = f"{kind}.{other}{rest[len(name):]}"
                    if f"{prefix}.{alt}" in saved:
                        renamed[key] = alt
                        break
    return renamed


def _restore_rng(path: Path, keys: set[str], trust: bool) -> None:
    """`keys`: the checkpoint's saved keys (its metadata, read once by `load`)."""
    # Every rank takes part in the (collective) load, also ranks the saving layout did not have.
    box = {"rng": {k: v for k, v in rng_state().items() if f"rng.{k}" in keys}}
    dcp_load(box, path, trust)
    for key, value in box["rng"].items():
        (torch.set_rng_state if key.endswith(".torch") else torch.cuda.set_rng_state)(value)


def _read_full_file(path: Path, trust: bool) -> dict[str, Any]:
    checkpoint = load_file(path, trust, map_location="cpu", mmap=True)
    full = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(full, dict) or not all(isinstance(v, torch.Tensor) for v in full.values()):
        raise CheckpointError(f"{path} is not a checkpoint: neither a bfpp checkpoint folder nor a file holding a "
                              "state dict of tensors (an export of python -m lightning_bfpp.checkpoint, or a "
                              "single-process Lightning checkpoint).")
    return checkpoint


def _load_full_file(path: Path, module: nn.Module, strict: bool, aliases: dict[str, list[str]],
                    optimizers: list[torch.optim.Optimizer], trust: bool,
                    param_order: list[str] | None) -> dict[str, Any]:
    """A plain Lightning checkpoint (single device, DDP, strategy="auto"; or `export --full`) or an exported file:
    full tensors by global name.

    Weights load into any layout; loops, LR schedulers and the optimizer state (torch's, by position: named with the
    optimizer's param groups, ``plain``) follow when the file has them. A file with weights only (an export) starts
    `fit` from those weights at step 0 with a fresh optimizer and LR schedule."""
    checkpoint = _read_full_file(path, trust)
    if optimizers and "lr_schedulers" not in checkpoint:
        rank_zero_warn(f"{path} holds weights only (an export): training starts from these weights at step 0 with a "
                       "fresh optimizer and LR schedule; resume from a bfpp checkpoint folder to continue a run "
                       "exactly.")
    checkpoint.setdefault("lr_schedulers", [])
    full = checkpoint.get("state_dict", checkpoint)
    local = get_model_state_dict(module)
    partial = check_model(path, tensor_shapes(full), local, strict, aliases)
    names = [k for k in local if k in full] if partial is None else sorted(partial)
    set_model_state_dict(module, {k: full[k] for k in names},
                         options=StateDictOptions(full_state_dict=True, strict=False))
    saved = checkpoint.get("optimizer_states") or []
    if optimizers and saved and partial is None:
        if len(saved) != len(optimizers) or param_order is None:
            raise CheckpointError(f"{path} holds {len(saved)} optimizer state(s); this model has {len(optimizers)} "
                                  "optimizer(s). Resume with the configure_optimizers it was saved with.")
        shapes = {k: v.shape for k, v in full.items() if isinstance(v, torch.Tensor)}
        for optimizer, plain_state in zip(optimizers, saved):
            groups = plain.optimizer_groups(module, optimizer, param_order, aliases)
            state, settings = plain.named_state(plain_state, groups, shapes, str(path))
            osd = plain.local_state_dict(module, optimizer, state, settings, param_order, aliases)
            if state:
                set_optimizer_state_dict(module, optimizer, osd, options=StateDictOptions(full_state_dict=True))
            else:  # no per-parameter state (e.g. SGD without momentum): torch's loader needs one; the settings alone
                for group, saved_group in zip(optimizer.param_groups, osd["param_groups"]):
                    group.update({k: v for k, v in saved_group.items() if k != "params"})
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    return checkpoint
