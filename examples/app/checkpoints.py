"""Checkpoints of a run: ``step-N.ckpt`` and ``last.ckpt`` under ``<run dir>/checkpoints``, what ``ckpt_path=auto``
resumes, the checks before resuming, and the Hugging Face directory written at the end (``checkpoint.export_hf``)."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from omegaconf import DictConfig

from . import run_dir as rundir
from .checks import ConfigError

log = logging.getLogger(__name__)


def checkpoint_meta(ckpt_path: str | None) -> dict:
    """Lightning's metadata of `ckpt_path` (a bfpp folder or a plain file), read without running code from it
    (BFPP_TRUST_CHECKPOINTS=1 to trust it); {} when there is none or it cannot be read (the strategy's
    pre-launch check names a bad ckpt_path)."""
    if not ckpt_path:
        return {}
    from lightning_bfpp.checkpoint import read_meta

    try:
        return read_meta(ckpt_path)
    except Exception:
        return {}


MODEL_SHAPE = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "tie_weights")


def check_resume_strategy(cfg: DictConfig) -> None:
    """A bfpp checkpoint folder given to trainer.strategy=auto (which reads one file): name the export command."""
    path = Path(str(cfg.ckpt_path)) if cfg.ckpt_path else None
    if cfg.trainer.strategy == "auto" and path is not None and path.is_dir():
        raise ConfigError(
            f"ckpt_path={path} is a folder (a bfpp checkpoint); trainer.strategy=auto resumes one file. Export it with "
            f"its optimizer and loop state: python -m lightning_bfpp.checkpoint {path} "
            f"{path.with_suffix('.plain.ckpt')} --full, then ckpt_path={path.with_suffix('.plain.ckpt')}.")


def check_resume_model(cfg: DictConfig) -> None:
    """`ckpt_path=` of an example GPT trained with other model.* shapes: name them in the app's keys (the strategy
    would name the mismatched parameters, and suggest a LightningModule setting the app has no key for)."""
    saved = checkpoint_meta(cfg.ckpt_path).get("hyper_parameters", {}).get("cfg")
    if not isinstance(saved, dict) or cfg.model.get("family", "gpt") != "gpt":
        return
    differ = [k for k in MODEL_SHAPE if k in saved and saved[k] != cfg.model.get(k)]
    if differ:
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path} was trained with {', '.join(f'model.{k}={saved[k]}' for k in differ)}; "
            f"this run has {', '.join(f'model.{k}={cfg.model.get(k)}' for k in differ)}. Resume with the "
            "checkpoint's settings ("
            + " ".join(f"model.{k}={saved[k]}" for k in differ) + "), or start without ckpt_path.")


def resolve_ckpt_path(cfg: DictConfig, run_dir: Path) -> None:
    """ckpt_path=auto: the newest complete checkpoint in <run dir>/checkpoints (a bfpp folder, or a plain file under
    trainer.strategy=auto), else none; says which. A rerun in the same run directory (hydra.run.dir=..., a SLURM
    requeue, a torchrun restart) so continues where the last one stopped. ckpt_path=null starts fresh."""
    folder = run_dir / "checkpoints"
    if cfg.ckpt_path is None:
        if rundir.global_rank() == "0" and folder.is_dir() and any(folder.iterdir()):
            log.info(f"ckpt_path=null: starting fresh, although {folder} holds checkpoints (ckpt_path=auto resumes "
                     "the newest)")
        return
    if cfg.ckpt_path != "auto":
        return
    from lightning_bfpp.checkpoint import StorageError, newest_to_resume

    # strategy=auto resumes plain files only; bfpp both its folders and plain files; a folder that cannot be read may
    # be the newest: refused rather than passed over
    candidates = []
    if cfg.trainer.strategy == "bfpp":
        try:
            newest_folder, passed = newest_to_resume(folder)
        except StorageError as err:
            raise ConfigError(f"ckpt_path=auto: {err}") from None
        candidates += [newest_folder] if newest_folder is not None else []
        for line in passed if rundir.global_rank() == "0" else []:
            log.info(f"ckpt_path=auto: {line}")
    if folder.is_dir():
        candidates += [p for p in folder.glob("*.ckpt") if p.is_file()]
    newest = max(candidates, key=lambda p: p.stat().st_mtime, default=None)
    cfg.ckpt_path = str(newest) if newest is not None else None
    if rundir.global_rank() == "0":
        log.info(f"ckpt_path=auto: resuming from {newest}" if newest is not None else
                 f"ckpt_path=auto: no checkpoint in {folder}, starting fresh")


class LastCheckpoint(Callback):
    """`<run dir>/checkpoints/last.ckpt`: the newest state, written with every `step-N.ckpt` and when training ends
    (when max_steps stops it mid-epoch: at that step's end, which Lightning resumes mid-epoch, so exactly),
    replaced in place (a run resumed into the same directory too). Lightning's own `save_last` skips the end of
    training once it has saved a periodic checkpoint (last.ckpt stayed at the last multiple of every_n_steps)."""

    def __init__(self, path: Path, every_n_steps: int):
        self.path, self.every, self.saved_at = path, every_n_steps, -1

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        # the last step saves here, mid-epoch: saved in on_train_epoch_end, Lightning would resume it at the next epoch
        last = 0 < trainer.max_steps <= trainer.global_step
        if (self.every > 0 and trainer.global_step % self.every == 0) or last:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save(trainer)

    def _save(self, trainer: L.Trainer) -> None:
        if trainer.global_step != self.saved_at and not trainer.fast_dev_run and trainer.global_step > 0:
            trainer.save_checkpoint(self.path, weights_only=False)  # named: Lightning logs its default on every rank
            self.saved_at = trainer.global_step


def checkpoint_callbacks(cfg: DictConfig, run_dir: Path) -> list[Callback]:
    """`step-N.ckpt` every checkpoint.every_n_steps steps (the newest checkpoint.keep of them; a run resumed into
    the same directory replaces a step's file) and `last.ckpt` (checkpoint.last)."""
    every, last = int(cfg.checkpoint.every_n_steps), bool(cfg.checkpoint.get("last", True))
    callbacks: list[Callback] = []
    if every > 0:
        # "step-200.ckpt": no '=' in the name, so `ckpt_path=<dir>/step-200.ckpt` needs no quoting for Hydra
        callbacks.append(ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="step-{step}",
                                         auto_insert_metric_name=False, every_n_train_steps=every,
                                         save_top_k=int(cfg.checkpoint.keep), monitor="step", mode="max",
                                         enable_version_counter=False))
    if last:
        callbacks.append(LastCheckpoint(run_dir / "checkpoints" / "last.ckpt", every))
    return callbacks


def export_hf(checkpoint: Path, out: Path) -> None:
    """`checkpoint` as a Hugging Face directory `out`, by the export command in a process of its own (the training
    processes' group is gone on the other ranks; the whole model is read there, not beside the run's memory)."""
    import subprocess

    cmd = [sys.executable, "-m", "lightning_bfpp.checkpoint", str(checkpoint), "--hf", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"checkpoint.export_hf={out}: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    log.info(f"exported the trained model to {out} (AutoModelForCausalLM.from_pretrained reads it)")

