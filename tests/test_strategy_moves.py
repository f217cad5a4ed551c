"""Checkpoints move between Lightning's strategies: a plain checkpoint (strategy="auto": one device, DDP) resumes
under bfpp with its optimizer state, and `python -m lightning_bfpp.checkpoint --full` turns a bfpp folder into a
plain checkpoint that strategy="auto" resumes. Each resume equals the one under the other strategy.

The checkpoints are of a finished epoch (16 steps), where Lightning itself resumes exactly: a mid-epoch plain
checkpoint restarts a non-stateful loader at the epoch's first batch under "auto", while bfpp skips the batches
already trained on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from exact_compare import PRECISION, assert_exact
from exact_model import StackNet, dataset
from launch import merged, run_lightning
from lightning.pytorch import Trainer
from one_process import as_float64
from torch.utils.data import DataLoader, DistributedSampler

import lightning_bfpp.checkpoint as ckpt

EPOCH, MORE, BATCH = 16, 10, 16  # steps in an epoch at batch 16; steps trained after the resume


def plain_loader() -> DataLoader:
    """The batches bfpp's replica draws at data_parallel=1 (Lightning's DistributedSampler: shuffled, seed 0)."""
    ds = dataset()
    return DataLoader(ds, batch_size=BATCH, drop_last=True,
                      sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0))


def fit_auto(opt: str, steps: int, ckpt_path: Path | None = None, save: Path | None = None) -> dict[str, torch.Tensor]:
    """Lightning's strategy="auto" on this process's CPU, in the exactness runs' precision (float64, as run_exact's
    bfpp runs); returns the final weights."""
    torch.manual_seed(0)
    # cast before fit: Lightning restores a plain checkpoint before DoublePrecision casts the model, so a float32
    # model would round the checkpoint's float64 weights to float32 on loading
    model = as_float64(StackNet(opt=opt))
    trainer = Trainer(accelerator="cpu", devices=1, strategy="auto", max_steps=steps, logger=False, precision=PRECISION,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      limit_val_batches=0)
    trainer.fit(model, plain_loader(), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}




@pytest.fixture(scope="module", params=[pytest.param("sgd", marks=pytest.mark.slow), "adamw_groups"])
def moves(request, tmp_path_factory):
    opt, root = request.param, tmp_path_factory.mktemp(f"moves-{request.param}")
    fit_auto(opt, EPOCH, save=root / "auto.ckpt")
    out = {"opt": opt, "root": root, "auto": fit_auto(opt, EPOCH + MORE, ckpt_path=root / "auto.ckpt")}
    # under bfpp (pp=2 on 2 processes): the auto checkpoint resumed, and a fresh epoch saved as a folder
    cfgs = [{"pp": 2, "m": 2, "opt": opt, "steps": EPOCH + MORE, "resume": str(root / "auto.ckpt")},
            {"pp": 2, "m": 2, "opt": opt, "steps": EPOCH, "save": str(root / "bfpp.ckpt")}]
    ranks = run_lightning(root / "bfpp", 2, cfgs)
    out["bfpp-from-auto"] = merged(ranks[0])
    return out


def test_auto_checkpoint_resumes_under_bfpp_with_its_optimizer_state(moves):
    """AdamW with nanoGPT's two param groups (and SGD): every parameter's state lands on the rank holding it."""
    assert_exact(moves["bfpp-from-auto"], moves["auto"], "params")


def test_exported_full_checkpoint_resumes_under_auto(moves, tmp_path):
    out = tmp_path / "plain.ckpt"
    ckpt.main([str(moves["root"] / "bfpp.ckpt"), str(out), "--full"])
    plain = torch.load(out, weights_only=False)
    assert {"optimizer_states", "loops", "lr_schedulers", "epoch", "global_step"} <= plain.keys()
    assert_exact(fit_auto(moves["opt"], EPOCH + MORE, ckpt_path=out), moves["auto"], "state")


@pytest.mark.slow
def test_a_plain_optimizer_of_other_groups_is_refused(tmp_path):
    """A plain checkpoint whose optimizer has other param groups than this model's: the error names both, and
    the fix."""
    bad = tmp_path / "groups.ckpt"
    fit_auto("adamw_groups", 1, save=bad)
    with pytest.raises(AssertionError,
                       match=r"2 param group\(s\) of \[\d+, \d+\] parameters; this model's optimizer has 1"):
        run_lightning(tmp_path / "run", 2, [{"pp": 2, "m": 2, "opt": "sgd", "steps": 3, "resume": str(bad)}])
