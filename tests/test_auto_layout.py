"""layout="auto": the planner's pick from measured layers (no processes: legality, pins, the printed report, the
errors, the per-sample measurement) and one 2-process CPU run that trains with the pick (the same on both ranks).
Run as a script (`python tests/test_auto_layout.py OUT`) it is that run's worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_bfpp.layout.auto import AutoLayout, default_cluster, measure_layers, plan_layout, report
from lightning_bfpp.layout.layer_cost import time_balanced_stage_layers
from lightning_bfpp.schedule import ScheduleError
from lightning_bfpp.schedule.dims import LayoutError, ParallelDims
from lightning_bfpp.schedule.stage_cut import balanced_stage_layers
from lightning_bfpp.sim import Layers, WireBytes

CPU = torch.device("cpu")


def layers(n_blocks: int = 8, head: float = 4e-5) -> Layers:
    """A GPT-like stack per sample: a light embedding, equal blocks and a head as slow as `head` seconds."""
    n = n_blocks + 2
    times = ((2e-6, 4e-6),) + ((1e-5, 2e-5),) * n_blocks + ((head / 3, 2 * head / 3),)
    return Layers(params=(50_000,) + (200_000,) * n_blocks + (60_000,), forward_flops=(0.0,) * n,
                  activation_bytes=(4e4,) * n, seq=64, width=64, times=times)


def cluster(world: int = 2, memory: float | None = None):
    c = default_cluster(CPU, world, world)
    return c if memory is None else type(c)(**{**c.__dict__, "device_memory": memory})


@pytest.mark.parametrize("world,batch", [(2, 8), (4, 16)])
def test_the_pick_is_legal_and_trains_the_global_batch(world, batch):
    ranked = plan_layout(layers(), cluster(world), world, batch, {})
    assert len(ranked) >= 2
    for plan, cut in ranked:
        c = plan.candidate
        dims = ParallelDims(world=world, spec=c.spec(), sharding=c.sharding).validate(num_layers=10, global_batch=batch)
        assert c.data_parallel == dims.data_parallel and c.data_parallel * c.micro_batches * c.micro_batch_size == batch
        assert len(cut) == c.pipeline_parallel * c.loops and sum(cut) == 10 and min(cut) >= 1
    # fastest first; equal speeds (to 1e-6 tokens/s: zero bubble can tie breadth-first to the last float bit) less
    # memory first
    keys = [(-round(p.tokens_per_second_per_device, 6), p.peak_memory) for p, _ in ranked]
    assert keys == sorted(keys)


@pytest.mark.parametrize("pinned", [{"schedule": "1f1b"}, {"pipeline_parallel": 2, "loops": 2},
                                    {"micro_batches": 4}, {"groups": 2}, {"sharding": "none", "schedule": "gpipe"},
                                    {"reshard_after_forward": True}])
def test_pinned_knobs_are_kept(pinned):
    ranked = plan_layout(layers(), cluster(), 2, 8, pinned)
    for plan, _ in ranked:
        assert {k: getattr(plan.candidate, k) for k in pinned} == pinned


@pytest.mark.parametrize("stage_count", [5, 10])  # loops 5 and 10 are not among the planner's default loops
def test_any_explicit_cut_length_is_searched(stage_count):
    ranked = plan_layout(layers(), cluster(), 2, 8, {}, stage_count=stage_count)
    assert ranked and all(p.candidate.pipeline_parallel * p.candidate.loops == stage_count for p, _ in ranked)


def test_an_explicit_cut_pins_the_number_of_stages():
    ranked = plan_layout(layers(), cluster(), 2, 8, {}, stage_count=4)
    assert {p.candidate.pipeline_parallel * p.candidate.loops for p, _ in ranked} == {4}


def test_the_cut_follows_measured_time():
    """A head as slow as 2.7 blocks: the last of two stages gets fewer layers than the parameter count gives."""
    slow_head = layers(head=8e-5)
    ranked = plan_layout(slow_head, cluster(), 2, 8, {"pipeline_parallel": 2, "loops": 1})
    assert balanced_stage_layers(list(slow_head.params), 2) == [5, 5]
    assert ranked[0][1] == time_balanced_stage_layers([f + b for f, b in slow_head.times], 2) == [6, 4]


def test_no_layout_keeps_the_pins_names_them():
    with pytest.raises(LayoutError, match=r"global_batch_size=8 that keeps micro_batches=3"):
        plan_layout(layers(), cluster(), 2, 8, {"micro_batches": 3})
    with pytest.raises(LayoutError, match="fits in 0.0 GB"):
        plan_layout(layers(), cluster(memory=1e4), 2, 8, {})
    with pytest.raises(ValueError, match="cannot pin"):
        plan_layout(layers(), cluster(), 2, 8, {"tensor_parallel": 2})


def test_report_names_the_pick_and_the_runner_up():
    ranked = plan_layout(layers(), cluster(), 2, 8, {"schedule": "breadth_first"})
    text = report(ranked, {"schedule": "breadth_first"})
    pick, runner_up = text.split("; runner-up ")
    assert "picked" in pick and "pinned: schedule='breadth_first'" in pick
    for part, (plan, _) in ((pick, ranked[0]),
                            (runner_up, next(r for r in ranked[1:] if r[0].step_time != ranked[0][0].step_time))):
        assert (f"predicted step {plan.step_time * 1e3:.1f} ms" in part
                and f"peak memory {plan.peak_memory / 1e6:.3g} MB" in part)


def test_strategy_settings():
    from lightning_bfpp import BFPPStrategy

    s = BFPPStrategy(layout="auto", global_batch_size=16, schedule="1f1b", loops=1)
    assert s.pinned == {"loops": 1, "schedule": "1f1b"} and isinstance(s.auto_layout, AutoLayout)
    assert BFPPStrategy(pipeline_parallel=2).pinned == {}  # no auto: nothing to pin
    with pytest.raises(ValueError, match="needs global_batch_size"):
        BFPPStrategy(layout="auto")
    with pytest.raises(ValueError, match="layout='manual'"):
        BFPPStrategy(layout="manual", global_batch_size=8)
    with pytest.raises(ScheduleError, match="groups"):  # pinned knobs that contradict each other fail at once
        BFPPStrategy(layout="auto", global_batch_size=8, schedule="gpipe", groups=2)


def test_the_training_loader_must_carry_the_replica_batch():
    from lightning_bfpp import BFPPStrategy

    s = BFPPStrategy(layout="auto", global_batch_size=16, pipeline_parallel=1, micro_batches=2)
    s._set_world(2)
    trainer = SimpleNamespace(training=True, fit_loop=SimpleNamespace(restarting=False))
    s._lightning_module = SimpleNamespace(trainer=trainer)
    assert s.replica_batch_size == 8
    loader = torch.utils.data.DataLoader(list(range(64)), batch_size=8)
    assert s.process_dataloader(loader) is loader
    with pytest.raises(LayoutError, match=r"batch_size=16 .*replica_batch_size \(8\)"):
        s.process_dataloader(torch.utils.data.DataLoader(list(range(64)), batch_size=16))


def test_measure_layers_is_per_sample():
    from exact_model import StackNet, dataset

    torch.manual_seed(0)
    model = StackNet(n_blocks=2)
    x, y = dataset()[:8]
    a = measure_layers(model, model.pipeline_layers(), x[:4], y[:4], CPU, repeats=1)
    b = measure_layers(model, model.pipeline_layers(), x, y, CPU, repeats=1)
    assert a.params == tuple(sum(p.numel() for p in layer.parameters()) for layer in model.pipeline_layers())
    assert all(v > 0 for v in a.activation_bytes) and a.activation_bytes == pytest.approx(b.activation_bytes)
    assert len(a.times) == 4 and all(f > 0 and bwd > 0 for f, bwd in a.times)
    assert a.seq * a.width == 16  # a block's output: 16 elements per sample cross a stage boundary
    assert a.wire == WireBytes(4, 4, 4)  # a 32-true run moves fp32 weights, gradients and messages
    mixed = measure_layers(model, model.pipeline_layers(), x[:4], y[:4], CPU, repeats=1, precision="bf16-mixed")
    assert mixed.wire == WireBytes(weights=2, grads=4, messages=2)


def test_app_schedule_layout_auto_pins_what_was_typed():
    import train
    from app_config import compose_app
    from hydra.core.hydra_config import HydraConfig

    typed = ["schedule.layout=auto", "schedule=1f1b", "schedule.micro_batches=4", "data.batch_size=16", "cluster=cpu_2"]
    cfg = compose_app(typed, hydra=True)
    HydraConfig.instance().set_config(cfg)
    try:
        built = train.build_strategy(cfg)
    finally:
        HydraConfig.instance().cfg = None
    assert built.pinned == {"schedule": "1f1b", "micro_batches": 4} and built.global_batch_size == 16
    assert tuple(built.auto_layout.sample.shape) == (4, cfg.model.block_size)  # 16 / (2 x 2 processes) rows
    cfg = compose_app(["cluster=cpu_2"])
    assert train.build_strategy(cfg).auto_layout is None  # the default: the knobs as given


def test_the_timed_micro_batch():
    """AutoLayout(sample=...) first, then example_input_array, then a DataLoader given to fit; a datamodule: error."""
    from exact_model import StackNet, dataset

    from lightning_bfpp.layout.auto import sample_inputs

    model = StackNet(n_blocks=1)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8)
    source = SimpleNamespace(instance=loader)
    model.trainer = SimpleNamespace(fit_loop=SimpleNamespace(_data_source=source))
    inputs, target = sample_inputs(model)
    assert inputs.shape == (8, 16) and target.shape == (8,)
    model.example_input_array = torch.ones(2, 16)
    assert torch.equal(sample_inputs(model)[0], torch.ones(2, 16)) and sample_inputs(model)[1] is None
    assert torch.equal(sample_inputs(model, torch.zeros(3, 16))[0], torch.zeros(3, 16))
    model.example_input_array, source.instance = None, SimpleNamespace()  # a datamodule: not set up yet
    with pytest.raises(ValueError, match="example_input_array"):
        sample_inputs(model)


# ---- one 2-process run (Lightning's launcher) ----
def test_two_processes_train_with_one_pick(tmp_path):
    import procenv

    env = procenv.clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_PORT=str(procenv.free_port()))
    p = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["layout"] == ranks[1]["layout"]
    layout = ranks[0]["layout"]
    assert (layout["replica_batch"] * layout["data_parallel"] == 16
            and layout["batches_seen"] == [layout["replica_batch"]] * 3)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in ranks) and len(ranks[0]["losses"]) == 3
    log = p.stdout + p.stderr
    assert log.count("layout='auto' (pinned: schedule='breadth_first') picked") == 1 and "runner-up" in log


def _worker(out: Path) -> None:
    import lightning.pytorch as pl
    from exact_model import StackNet, dataset

    from lightning_bfpp import BFPPStrategy

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            replicas = self.trainer.strategy.distributed_sampler_kwargs
            sampler = torch.utils.data.DistributedSampler(dataset(), shuffle=False, **replicas)
            return torch.utils.data.DataLoader(dataset(), batch_size=self.trainer.strategy.replica_batch_size,
                                               sampler=sampler, drop_last=True)

    class Recorder(pl.Callback):
        losses, seen = [], []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))
            self.seen.append(len(batch[0]))

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = StackNet(n_blocks=4)
    model.example_input_array = dataset()[:4][0]
    strategy = BFPPStrategy(layout=AutoLayout(repeats=1), global_batch_size=16, schedule="breadth_first")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Recorder()])
    trainer.fit(model, datamodule=Data())
    s = trainer.strategy
    layout = {"schedule": s.spec.name, "pipeline_parallel": s.pipeline_parallel, "loops": s.loops,
              "micro_batches": s.micro_batches, "groups": s.spec.groups, "sharding": s.sharding,
              "data_parallel": s.data_parallel, "stage_layers": s.stage_layers,
              "replica_batch": s.replica_batch_size, "batches_seen": Recorder.seen}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"layout": layout, "losses": Recorder.losses}))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
