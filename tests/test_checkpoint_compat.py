"""A checkpoint folder written by an earlier version of the package still resumes exactly.

tests/data/pre_move/step-2.ckpt was written by the app with the package's flat module layout (before its modules
moved into folders), with the command in tests/data/pre_move/README.md; summary.json is that run's summary at step 2.
Today's code resumes it to step 4 and must end with the weights of an uninterrupted 4-step run.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_app import run_cli

import lightning_bfpp.checkpoint as ckpt

DATA = Path(__file__).parent / "data" / "pre_move"
# the arguments the folder was written with, less its step count and checkpoint keys
ARGS = ["optim=adamw", "logger=csv", "cluster=cpu_2", "schedule.pipeline_parallel=2", "schedule.loops=2",
        "schedule.micro_batches=2", "model.n_layer=4", "model.n_head=2", "model.n_embd=16", "model.block_size=16",
        "data.max_bytes=200000", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false", "checkpoint.every_n_steps=0", "checkpoint.last=true",
        "trainer.max_steps=4"]


def _train_losses(run_dir: Path) -> list[float]:
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as f:
        return [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]


@pytest.mark.slow
def test_checkpoint_written_before_the_move_resumes_exactly(tmp_path):
    folder = tmp_path / "step-2.ckpt"
    shutil.copytree(DATA / "step-2.ckpt", folder)  # resuming may tidy the folder's parent; keep the test data as is
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_cli(ARGS + [f"hydra.run.dir={straight}"], cwd=tmp_path)
    # today's code trains the first two steps as the code that wrote the folder did
    then = json.loads((DATA / "summary.json").read_text())
    assert then["steps"] == 2
    assert abs(_train_losses(straight)[1] - then["train_loss"]) <= 1e-6 * then["train_loss"]
    run_cli(ARGS + [f"ckpt_path={folder}", f"hydra.run.dir={resumed}"], cwd=tmp_path)
    assert len(_train_losses(resumed)) == 2  # steps 3 and 4 only
    a = ckpt.export(straight / "checkpoints" / "last.ckpt", tmp_path / "straight.pt")
    b = ckpt.export(resumed / "checkpoints" / "last.ckpt", tmp_path / "resumed.pt")
    assert a.keys() == b.keys() and len(a) > 0
    for name, tensor in a.items():
        torch.testing.assert_close(b[name], tensor, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
