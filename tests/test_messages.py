"""Messages and errors a newcomer meets, checked without processes (issue 54; what a launched run prints:
tests/test_run_output.py): errors name the fix (fp16, schedules from the registry, the nearest valid batch sizes, a
ragged training batch refused before training), misspelt command-line keys get "did you mean" before Hydra's advice,
the schedule picture and the summary say what is planned and what is measured, sweep folders carry the swept values,
and a resumed run keeps one metrics file."""

from __future__ import annotations

import csv
import subprocess
import sys
from types import SimpleNamespace

import lightning as L
import pytest
from app import run_dir as rundir
from app.checks import ConfigError, check_config
from app.command_line import check_command_line
from app_config import compose_app
from hydra.core.hydra_config import HydraConfig
from procenv import clean_env
from torch.utils.data import DataLoader

from lightning_bfpp import BFPPStrategy, ScheduleError, ScheduleSpec
from lightning_bfpp.adapter.lightning_output import summary_note
from lightning_bfpp.adapter.loader import check_training_loader
from lightning_bfpp.adapter.metrics import PipelineMetrics
from lightning_bfpp.schedule import BREADTH_FIRST, LOOPED_SCHEDULES, SCHEDULES, check_spec
from lightning_bfpp.schedule.dims import LayoutError, ParallelDims, nearest_multiples
from lightning_bfpp.sim import draw


# ---- errors that name the fix ----
@pytest.mark.parametrize("strategy", [BFPPStrategy(pipeline_parallel=1), "bfpp"], ids=["instance", "name"])
def test_fp16_mixed_names_bf16_mixed_before_lightning_suggests_16_true(strategy):
    with pytest.raises(ValueError) as err:
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="16-mixed", logger=False)
    assert str(err.value).startswith("precision='16-mixed': strategy='bfpp' does not support fp16")
    assert "use precision='bf16-mixed'" in str(err.value) and "'16-true'" not in str(err.value)
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", logger=False)


def test_other_strategies_keep_lightnings_own_precision_rules():
    L.Trainer(accelerator="cpu", devices=1, strategy="ddp", precision="16-mixed", logger=False)  # its bf16 fallback


def _error(check, *args) -> str:
    with pytest.raises((ScheduleError, ConfigError)) as err:
        check(*args)
    return str(err.value)


def test_every_error_that_lists_schedules_lists_the_registry():
    listing_all = [
        _error(check_spec, ScheduleSpec("zigzag")),
        _error(check_config, compose_app(["schedule=base"])),  # the app's (it left out breadth_first_zb)
        _error(check_command_line, ["schedule=breadth_frist"]),
    ]
    for message in listing_all:
        assert all(name in message for name in SCHEDULES), message
    looped = _error(check_spec, ScheduleSpec("gpipe", pipeline_parallel=2, loops=2, micro_batches=2))
    assert all(name in looped for name in LOOPED_SCHEDULES), looped
    grouped = _error(check_spec, ScheduleSpec("1f1b", pipeline_parallel=2, micro_batches=4, groups=2))
    assert all(name in grouped for name in BREADTH_FIRST), grouped


def test_a_batch_that_does_not_split_lists_the_nearest_valid_sizes():
    assert nearest_multiples(6, 4) == [4, 8] and nearest_multiples(3, 4) == [4] and nearest_multiples(30, 8) == [24, 32]
    with pytest.raises(LayoutError, match=r"the dataloader's batch_size=6 \(per data-parallel replica\) is not a "
                                          r"multiple of micro_batches=4; use the dataloader's batch_size=4 or 8, or "
                                          r"micro_batches in \[2, 3, 6\]"):
        BFPPStrategy(pipeline_parallel=2, micro_batches=4).process_dataloader(DataLoader(range(12), batch_size=6))
    dims = ParallelDims(world=2, spec=ScheduleSpec(pipeline_parallel=1, micro_batches=4))
    with pytest.raises(LayoutError, match=r"the global batch=30 .* use the global batch=24 or 32"):
        dims.replica_batch(30)


def test_a_ragged_training_batch_that_would_not_split_is_refused_when_the_run_reaches_it():
    plan = BFPPStrategy(pipeline_parallel=1, micro_batches=4).plan
    ragged = DataLoader(range(37), batch_size=8)  # 4 batches of 8, then 5 samples
    whole_epochs = SimpleNamespace(limit_train_batches=1.0, max_steps=-1, accumulate_grad_batches=1)
    with pytest.raises(LayoutError, match=r"last batch of each epoch would have 5 samples \(37 samples per "
                                          r"data-parallel replica in batches of 8\), not a multiple of "
                                          r"micro_batches=4, so that step could not run: set drop_last=True"):
        check_training_loader(ragged, plan, whole_epochs)
    check_training_loader(DataLoader(range(37), batch_size=8, drop_last=True), plan, whole_epochs)
    check_training_loader(DataLoader(range(36), batch_size=8), plan, whole_epochs)  # a last batch of 4 splits
    for stops_earlier in ({"limit_train_batches": 4}, {"limit_train_batches": 0.5}, {"max_steps": 4},
                          {"max_steps": 2, "accumulate_grad_batches": 2}):
        check_training_loader(ragged, plan, SimpleNamespace(**{**vars(whole_epochs), **stops_earlier}))
    with pytest.raises(LayoutError):
        check_training_loader(ragged, plan, SimpleNamespace(**{**vars(whole_epochs), "max_steps": 5}))


RAGGED_SCRIPT = """
import lightning as L, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_bfpp import BFPPStrategy, PipelineHooks

class Net(PipelineHooks, L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    def pipeline_layers(self): return list(self.layers)
    def pipeline_loss(self, out, y): return nn.functional.mse_loss(out, y)
    def training_step(self, batch, batch_idx): return self.pipeline_loss(self.pipeline_forward(batch[0]), batch[1])
    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.1)
    def on_train_batch_start(self, batch, batch_idx): print("TRAINED A BATCH", flush=True)

data = DataLoader(TensorDataset(torch.randn(37, 4), torch.randn(37, 4)), batch_size=8)  # no drop_last
L.Trainer(accelerator="cpu", devices=1, strategy=BFPPStrategy(micro_batches=4), max_epochs=1, logger=False,
          enable_checkpointing=False, use_distributed_sampler=False).fit(Net(), data)
"""


def test_a_ragged_training_loader_is_refused_before_the_first_step(tmp_path):
    """Through the Trainer: the loader is refused when Lightning hands it over, not at the epoch's end."""
    proc = subprocess.run([sys.executable, "-c", RAGGED_SCRIPT], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "would have 5 samples" in proc.stderr and "set drop_last=True" in proc.stderr, proc.stderr[-3000:]
    assert "TRAINED A BATCH" not in proc.stdout


# ---- the command line, before Hydra ----
@pytest.mark.parametrize("argv, message", [
    (["trainer.max_step=10"], "trainer.max_step=10: the config has no key trainer.max_step; did you mean "
                              "trainer.max_steps? (trainer.max_steps=10)"),
    (["traner.max_steps=10"], "did you mean trainer.max_steps?"),
    (["trainer.max_epoch=1"], "did you mean trainer.max_epochs? (+trainer.max_epochs=1: a lightning.Trainer argument "
                              "conf/train.yaml does not list)"),
    (["trainer.max_epochs=1"], "max_epochs is a lightning.Trainer argument that conf/train.yaml does not list; add it "
                               "with +trainer.max_epochs=1."),
    (["trainer.devices=2"], "examples/train.py sets trainer.devices from cluster.devices"),
    (["model.n_layers=2"], "did you mean model.n_layer?"),
    (["model=hf_llama_tiny", "model.n_kv_heads=1"], "did you mean model.n_kv_head?"),  # the chosen file's keys
    (["ckpt_pth=x"], "did you mean ckpt_path?"),
    (["-m", "schedule=breadth_first,depht_first"], "schedule=depht_first: conf/schedule/ has no depht_first.yaml; "
                                                   "did you mean schedule=depth_first?"),
    (["model=gpt_tiy"], "did you mean model=gpt_tiny?"),
])
def test_a_misspelt_key_or_file_gets_did_you_mean(argv, message):
    assert message in _error(check_command_line, argv)


@pytest.mark.parametrize("argv", [
    ["trainer.max_steps=10", "+trainer.max_epochs=1", "schedule=gpipe", "hydra.run.dir=x", "--cfg", "job"],
    ["-m", "schedule.micro_batches=2,4", "schedule=breadth_first,1f1b"],
    ["foo.bar=1"],  # close to nothing the app has: Hydra's own message
    ["model=hf_pretrained", "model.path=/nowhere"],  # a key whose value is missing (???) exists
])
def test_keys_the_app_has_or_cannot_guess_pass(argv):
    check_command_line(argv)


# ---- planned and measured ----
def test_the_schedule_picture_says_its_numbers_are_planned(monkeypatch, tmp_path):
    drawn = {}
    monkeypatch.setattr(draw, "_render", lambda events, path, title, stats, n: drawn.update(stats=stats) or path)
    spec = ScheduleSpec("gpipe", pipeline_parallel=2, micro_batches=4)
    draw.draw_schedule(spec, tmp_path / "schedule.png")
    planned = draw.planned_step(spec)
    assert drawn["stats"].startswith(f"planned (simulated): step {planned.step_time:.4g}   bubble {planned.bubble:.3f}")


def test_the_summary_says_which_numbers_are_measured():
    metrics = PipelineMetrics(warmup_steps=0)
    metrics.planned_bubble = 0.175
    metrics.history = [{"step": 1, "tokens_per_s": 10.0, "step_s": 1.0, "bubble_fraction": 0.5}]
    trainer = SimpleNamespace(callback_metrics={}, global_step=1, world_size=2, strategy=SimpleNamespace())
    summary = metrics.summary(trainer)
    assert summary["bubble_fraction"] == 0.5 and summary["planned_bubble_fraction"] == 0.175
    assert summary["measured"].startswith("tokens_per_s, step_s, model_flops_per_s, mfu and bubble_fraction are "
                                          "measured in this run")


def test_the_model_summary_note_names_the_ranks_stages():
    dims = ParallelDims(world=4, spec=ScheduleSpec(pipeline_parallel=2, loops=2, micro_batches=2))
    assert summary_note(dims, 2).startswith(
        "bfpp: the model summary shows global rank 2's modules: pipeline rank 1's stages 1, 3 of 4;")


# ---- finding one's way in the app's folders ----
def test_sweep_folders_carry_the_swept_values(monkeypatch):
    job = ["schedule=1f1b", "schedule.micro_batches=4", "cluster=cpu_2"]  # one job's overrides
    HydraConfig.instance().set_config(compose_app(job, hydra=True))
    try:
        monkeypatch.setattr(sys, "argv", ["train.py", "-m", "schedule=gpipe,1f1b", "schedule.micro_batches=2,4",
                                          "cluster=cpu_2"])
        assert rundir.swept_values("1f1b") == "schedule-1f1b_micro_batches-4"
        monkeypatch.setattr(sys, "argv", ["train.py", "-m", *job])  # nothing swept on the command line
        assert rundir.swept_values("1f1b") == "1f1b"
    finally:
        HydraConfig.instance().cfg = None


def test_a_resume_into_the_run_directory_continues_its_metrics_file(tmp_path):
    from app.csv_log import ContinuedWriter

    log_dir = tmp_path / "csv" / "version_0"
    log_dir.mkdir(parents=True)
    (log_dir / "metrics.csv").write_text("epoch,step,train_loss\n0,0,5.0\n0,1,4.0\n0,2,3.0\n0,3,2.5\n")
    writer = ContinuedWriter(str(log_dir), resumed_step=2)  # a checkpoint of step 2: steps 2 and 3 are trained again
    writer.log_metrics({"epoch": 0, "train_loss": 3.1}, step=2)
    writer.log_metrics({"epoch": 0, "val_loss": 3.3}, step=2)  # a new column
    writer.save()
    with open(log_dir / "metrics.csv") as f:
        rows = [(r["step"], r["train_loss"], r["val_loss"]) for r in csv.DictReader(f)]
    assert rows == [("0", "5.0", ""), ("1", "4.0", ""), ("2", "3.1", ""), ("2", "", "3.3")]
    ContinuedWriter(str(log_dir), resumed_step=None)  # a fresh run in that directory starts the file anew
    assert not (log_dir / "metrics.csv").exists()
