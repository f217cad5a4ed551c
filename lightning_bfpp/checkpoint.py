# Scope: sharded checkpoints keyed by the model's global parameter names, so a checkpoint written with
# one (pp, loops, dp) loads into any other layout; atomic saves; export to one plain state-dict file.
from __future__ import annotations

import argparse
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

META_FILE = "meta.pt"  # Lightning's metadata file name: loops, schedulers, callbacks, epoch, step
# Optimizer state flattened to per-parameter keys ("state.blocks.3.fc.weight.exp_avg", "param_groups.
# blocks.3.fc.weight.lr"): every rank saves and loads exactly its parameters' entries, whatever the layout.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
MODEL_OPTIONS = StateDictOptions()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> dict[str, torch.Tensor]:
    state = {f"rank{_rank()}.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"rank{_rank()}.cuda"] = torch.cuda.get_rng_state()
    return state


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(module, optimizer, options=OPTIM_OPTIONS)


def save(path: Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write `state` (tensors, sharded or not) with torch.distributed.checkpoint on all ranks, plus rank 0's
    `meta`. The folder appears under `path` only once complete: an interrupted save leaves a hidden
    `.tmp-*` folder that is never taken for a checkpoint."""
    path = Path(path)
    token = [uuid.uuid4().hex if _rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    tmp = path.parent / f".{path.name}.tmp-{token[0][:8]}"
    dcp.save({**state, "rng": rng_state()}, checkpoint_id=tmp)
    if _rank() == 0:
        torch.save(meta, tmp / META_FILE)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        tmp.rename(path)
    _barrier()


def is_sharded(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def load(
    path: Path,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    strict: bool = True,
    aliases: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint (any layout) or a single full file into the local stages; return metadata.

    `aliases`: other names of a shared (tied) weight. A layout with one copy saves its optimizer state under
    one name only; a layout with a copy per stage reads each copy's state from whichever name was saved."""
    path = Path(path)
    if is_sharded(path):
        model_state = {"state_dict": get_model_state_dict(module, options=MODEL_OPTIONS)}
        dcp.load(model_state, checkpoint_id=path)
        set_model_state_dict(module, model_state["state_dict"], options=StateDictOptions(strict=strict))
        saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        for i, opt in enumerate(optimizers):
            wanted = optimizer_state(module, opt)
            renamed = _saved_names(wanted, f"optimizer_{i}", saved, aliases or {})
            request = {f"optimizer_{i}": {renamed.get(k, k): v for k, v in wanted.items()}}
            dcp.load(request, checkpoint_id=path)
            back = {v: k for k, v in renamed.items()}
            loaded = {back.get(k, k): v for k, v in request[f"optimizer_{i}"].items()}
            set_optimizer_state_dict(module, opt, loaded, options=OPTIM_OPTIONS)
        _restore_rng(path, saved)
        return torch.load(path / META_FILE, weights_only=False)
    if path.is_file():
        return _load_full_file(path, module, strict)
    raise FileNotFoundError(f"ckpt_path={str(path)!r} is neither a bfpp checkpoint folder (with {META_FILE}) nor a file.")


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


def _restore_rng(path: Path, keys: set[str]) -> None:
    """`keys`: the checkpoint's saved keys (its metadata, read once by `load`)."""
    # Every rank takes part in the (collective) load, also ranks the saving layout did not have.
    box = {"rng": {k: v for k, v in rng_state().items() if f"rng.{k}" in keys}}
    dcp.load(box, checkpoint_id=path)
    for key, value in box["rng"].items():
        (torch.set_rng_state if key.endswith(".torch") else torch.cuda.set_rng_state)(value)


def _load_full_file(path: Path, module: nn.Module, strict: bool) -> dict[str, Any]:
    """A plain (single-process) Lightning checkpoint or an exported file: full tensors by global name.

    Weights load into any layout (validate/test/predict with ``ckpt_path=file``); loops and LR schedulers
    follow when the file has them. Optimizer state in Lightning's id-keyed form is not restored."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if checkpoint.get("optimizer_states"):
        rank_zero_warn(f"{path}: a plain checkpoint's optimizer state is not restored under strategy='bfpp' "
                       "(only weights, loops and schedulers); resume from a bfpp checkpoint folder for exact resume.")
    full = checkpoint.get("state_dict", checkpoint)
    local = get_model_state_dict(module)
    missing = [k for k in local if k not in full]
    if missing and strict:
        raise KeyError(f"{path} lacks parameters {missing[:3]} of this model")
    set_model_state_dict(
        module, {k: full[k] for k in local if k in full}, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def export(checkpoint_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    """Consolidate a bfpp checkpoint folder into one file: {"state_dict": {name: full tensor}, plus the
    Lightning metadata (epoch, global_step, hyper_parameters)} — `Model.load_from_checkpoint(out)` and
    `model.load_state_dict(torch.load(out)["state_dict"], strict=True)` work with no process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    if not is_sharded(checkpoint_dir):
        raise FileNotFoundError(f"{checkpoint_dir} is not a bfpp checkpoint folder (no {META_FILE}).")
    tmp = out.with_name(out.name + ".dcp.tmp")
    dcp_to_torch_save(checkpoint_dir, tmp)
    everything = torch.load(tmp, weights_only=False)
    tmp.unlink()
    meta = torch.load(checkpoint_dir / META_FILE, weights_only=False)
    state_dict = {k: v.detach().clone() for k, v in everything["state_dict"].items()}
    keep = {k: v for k, v in meta.items() if k not in ("loops", "callbacks", "optimizer_states", "lr_schedulers")}
    torch.save({**keep, "state_dict": state_dict}, out)
    return state_dict


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m lightning_bfpp.checkpoint",
        description="Export a bfpp (sharded) checkpoint folder to one plain state-dict file.",
    )
    p.add_argument("checkpoint", type=Path, help="checkpoint folder written by strategy='bfpp'")
    p.add_argument("out", type=Path, help="output file, e.g. model.ckpt")
    a = p.parse_args(argv)
    state = export(a.checkpoint, a.out)
    n = sum(t.numel() for t in state.values())
    print(f"wrote {a.out}: {len(state)} tensors, {n:,} parameters")


if __name__ == "__main__":
    main()
