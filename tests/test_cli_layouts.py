"""The command lines users type: one model, several layouts, same numbers; resume and export."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import lightning as L
import pytest
import torch
from app_config import compose_app
from test_app import ROOT, clean_env, run_cli

COMMON = ["optim=sgd", "logger=csv", "trainer.max_steps=3", "trainer.limit_val_batches=2",
          "trainer.val_check_interval=3", "trainer.enable_progress_bar=false", "data.max_bytes=400000"]


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _last_eval(run_dir) -> dict[str, float]:
    """The GPT's torchmetrics (val_acc, val_bpb) of the last validation, from the CSV logger."""
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("val_acc")]
    return {k: float(rows[-1][k]) for k in ("val_acc", "val_bpb")}


ONE_PROCESS = ["cluster=cpu_1", "schedule.pipeline_parallel=1", "schedule.loops=1", "schedule.micro_batches=1"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single-process bfpp run (pp=1) that several layouts are compared with: run once per module."""
    tmp = tmp_path_factory.mktemp("one_process")
    run_cli(COMMON + ONE_PROCESS + [f"hydra.run.dir={tmp / 'run'}"], cwd=tmp)
    return tmp / "run"


def _values(run_dir) -> tuple[float, ...]:
    s = _summary(run_dir)
    assert s["steps"] == 3 and s["data_parallel"] == 1
    return (s["train_loss"], s["val_loss"], *_last_eval(run_dir).values())


@pytest.mark.slow
def test_same_train_loss_on_one_two_and_four_processes(tmp_path, one_process):
    """optim=sgd, same data and steps: plain Lightning (strategy=auto) and bfpp pp=1 (1 process), pp=2 x loops=2 (2,
    breadth_first and breadth_first_zb), pp=4 x loops=1 (4): the same losses and the same torchmetrics values (the GPT's
    own validation_step)."""
    layouts = {
        "auto": ["cluster=cpu_1", "trainer.strategy=auto"],
        "cpu2": ["cluster=cpu_2", "schedule.pipeline_parallel=2", "schedule.loops=2", "schedule.micro_batches=4"],
        "cpu4": ["cluster=cpu_4", "schedule.pipeline_parallel=4", "schedule.loops=1", "schedule.micro_batches=4"],
        "cpu2-zb": ["cluster=cpu_2", "schedule=breadth_first_zb", "schedule.pipeline_parallel=2", "schedule.loops=2",
                    "schedule.micro_batches=4"],  # zero-bubble breadth-first
    }
    losses = {"cpu1": _values(one_process)}
    for name, args in layouts.items():
        run_cli(COMMON + args + [f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path)
        losses[name] = _values(tmp_path / name)
    base = losses["auto"]
    for values in losses.values():
        assert all(abs(v - b) <= 1e-5 * b for v, b in zip(values, base)), losses


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_from_the_command_line_matches_one_process(tmp_path, one_process, sequence_parallel):
    """schedule.tensor_parallel=2 with pipeline_parallel=2 on 4 processes (dp 1), with and without
    schedule.sequence_parallel: the GPT's blocks, embedding and head split by its pipeline_tp_plan give the
    single-process losses and torchmetrics values (optim=sgd)."""
    tp2 = ["cluster=cpu_4", "schedule.pipeline_parallel=2", "schedule.tensor_parallel=2", "schedule.loops=1",
           "schedule.micro_batches=2", f"schedule.sequence_parallel={str(sequence_parallel).lower()}"]
    run_cli(COMMON + tp2 + [f"hydra.run.dir={tmp_path / 'tp2'}"], cwd=tmp_path)
    assert _summary(tmp_path / "tp2")["sequence_parallel"] is sequence_parallel
    values = {"cpu1": _values(one_process), "tp2": _values(tmp_path / "tp2")}
    assert all(abs(v - b) <= 1e-5 * b for v, b in zip(values["tp2"], values["cpu1"])), values


@pytest.mark.slow
def test_tied_embeddings_across_stages_match_one_process(tmp_path):
    """model.tie_weights=true: the embedding (first stage) and the output head (last stage, other pipeline rank)
    share one matrix; pp=2 x loops=2 trains it like the single-process model."""
    layouts = {
        "cpu1": ONE_PROCESS,
        "cpu2": ["cluster=cpu_2", "schedule.pipeline_parallel=2", "schedule.loops=2", "schedule.micro_batches=4"],
    }
    losses = {}
    for name, args in layouts.items():
        run_cli(COMMON + args + ["model.tie_weights=true", f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path)
        s = _summary(tmp_path / name)
        losses[name] = (s["train_loss"], s["val_loss"])
    (train1, val1), (train2, val2) = losses["cpu1"], losses["cpu2"]
    assert abs(train2 - train1) <= 1e-5 * train1 and abs(val2 - val1) <= 1e-5 * val1, losses


@pytest.mark.slow
def test_cli_checkpoint_resume_and_export(tmp_path):
    layout = ["cluster=cpu_2", "schedule.pipeline_parallel=2", "schedule.loops=2", "schedule.micro_batches=2",
              "trainer.max_steps=4", "trainer.val_check_interval=4"]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    run_cli(COMMON + layout + ["checkpoint.every_n_steps=2", f"hydra.run.dir={first}"], cwd=tmp_path)
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["last.ckpt", "step-2.ckpt", "step-4.ckpt"]
    # resume from step 2 in another layout (pp=4, loops=1 on 4 processes): same last-step losses
    run_cli(COMMON + ["cluster=cpu_4", "schedule.pipeline_parallel=4", "schedule.loops=1", "schedule.micro_batches=2",
                      "trainer.max_steps=4", "trainer.val_check_interval=4",
                      f"ckpt_path={first / 'checkpoints' / 'step-2.ckpt'}", f"hydra.run.dir={resumed}"], cwd=tmp_path)
    assert (resumed / "checkpoints" / "last.ckpt" / "meta.pt").exists()  # a resumed run keeps checkpointing
    a, b = _summary(first), _summary(resumed)
    assert abs(a["train_loss"] - b["train_loss"]) <= 1e-5 * a["train_loss"], (a["train_loss"], b["train_loss"])
    assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * a["val_loss"]

    # export the sharded checkpoint: the plain example GPT loads it strictly and validates to the same loss
    out = tmp_path / "gpt.ckpt"
    subprocess.run([sys.executable, "-m", "lightning_bfpp.checkpoint", str(first / "checkpoints" / "step-4.ckpt"),
                    str(out)], env=clean_env(), cwd=ROOT, check=True, capture_output=True, timeout=120)
    from data import CorpusDataModule
    from gpt import GPT, GPTConfig

    cfg = compose_app(COMMON + layout)
    model = GPT(GPTConfig(**{k: v for k, v in cfg.model.items() if k != "name"}))
    model.load_state_dict(torch.load(out, weights_only=False)["state_dict"], strict=True)
    loaded = GPT.load_from_checkpoint(out)  # as docs/checkpoints.md shows: the hyperparameters travel with the weights
    assert loaded.cfg.n_layer == cfg.model.n_layer and loaded.optim.name == "sgd" and loaded.optim.lr == cfg.optim.lr
    assert all(torch.equal(t, loaded.state_dict()[k]) for k, t in model.state_dict().items())
    data = CorpusDataModule(**{k: v for k, v in cfg.data.items() if k != "name"})
    trainer = L.Trainer(accelerator="cpu", devices=1, limit_val_batches=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    assert val == pytest.approx(a["val_loss"], rel=1e-5)
