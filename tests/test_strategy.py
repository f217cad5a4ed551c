"""Strategy settings, registration and the model contract, checked without starting processes."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from exact_model import StackNet
from launch import ROOT, clean_env
from lightning.pytorch import Trainer
from torch import nn

import lightning_bfpp
from lightning_bfpp import BFPPStrategy, ScheduleError
from lightning_bfpp.layout.cut import plan_stages, split_stages
from lightning_bfpp.layout.remote import RemoteLayer
from lightning_bfpp.runtime.measure import measure_now
from lightning_bfpp.schedule.stage_cut import balanced_stage_layers


def test_string_name_registers_the_strategy():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="bfpp", logger=False)
    assert isinstance(trainer.strategy, BFPPStrategy)
    assert trainer.strategy.spec.name == "breadth_first"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"schedule": "gpipe", "loops": 2}, ScheduleError, "schedule=gpipe is not looped"),
        ({"pipeline_parallel": 2, "micro_batches": -1}, ScheduleError, "micro_batches=-1"),
        ({"sharding": "zero2"}, ValueError, "sharding='zero2'"),
        ({"pipeline_parallel": 0}, ScheduleError, "pipeline_parallel=0 must be a positive integer"),
        ({"pipeline_parallel": 2, "loops": 2, "stage_layers": [1, 2]}, ValueError,
         r"stage_layers=\[1, 2\] must list 4"),
        ({"pipeline_parallel": 2, "stage_layers": [3, 0]}, ValueError, r"stage_layers=\[3, 0\] must list 2 positive"),
        # 0 and "" are refused, not taken for "not given" (None)
        ({"pipeline_parallel": 2, "loops": 0}, ScheduleError, "loops=0 must be a positive integer"),
        ({"groups": 0}, ScheduleError, "groups=0 must be a positive integer"),
        ({"schedule": ""}, ScheduleError, "schedule='' is unknown"),
        ({"sharding": ""}, ValueError, "sharding='' is unknown"),
        ({"global_batch_size": 0}, ValueError, "global_batch_size=0 must be a positive integer"),
        ({"layout": "auto", "global_batch_size": 8, "tensor_parallel": 2}, ValueError,
         "searches tensor_parallel=1 only"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        BFPPStrategy(**kwargs)


def test_measurement_runs_on_logging_steps_every_n_steps_or_never():
    def measured(strategy, log_every=5, max_steps=12):
        return [g for g in range(12)
                if measure_now(SimpleNamespace(log_every_n_steps=log_every, global_step=g, max_steps=max_steps),
                               strategy.measure_every_n_steps)]

    assert measured(BFPPStrategy()) == [4, 9, 11]  # Lightning's logging steps and the last step
    assert measured(BFPPStrategy(), max_steps=-1) == [4, 9]
    assert measured(BFPPStrategy(measure_every_n_steps=3)) == [2, 5, 8, 11]
    assert measured(BFPPStrategy(measure_every_n_steps=0)) == []
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"measure_every_n_steps={bad!r} must be None"):
            BFPPStrategy(measure_every_n_steps=bad)


def test_precision_plugin_becomes_a_subclass_that_clips_globally_and_skips_autocast_under_fsdp():
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    from lightning_bfpp.adapter.precision import PipelinePrecision, pipeline_precision

    calls = []
    original = MixedPrecision("bf16-mixed", "cpu")
    plugin = pipeline_precision(original, lambda params, norm: calls.append((list(params), norm)), fsdp_mixed=False)
    assert isinstance(plugin, MixedPrecision) and isinstance(plugin, PipelinePrecision) and plugin is not original
    assert type(plugin).__name__ == "PipelineMixedPrecision" and plugin.precision == "bf16-mixed"
    assert "clip_grad_by_norm" not in vars(plugin) and "forward_context" not in vars(original)  # nothing patched
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu")
    assert pipeline_precision(plugin, plugin.clip_norm, fsdp_mixed=True) is plugin
    with plugin.forward_context():
        assert not torch.is_autocast_enabled("cpu")
    weight = torch.nn.Parameter(torch.ones(2))
    plugin.clip_grad_by_norm(torch.optim.SGD([weight], lr=1.0), 0.5)
    assert calls == [([weight], 0.5)]
    assert type(pipeline_precision(Precision(), print, fsdp_mixed=False)) is PipelinePrecision


def test_global_norm_clipping_matches_torch_and_counts_copies_once():
    import torch

    from lightning_bfpp.runtime.reduce import clip_grad_norm_global

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    copy = torch.nn.Parameter(params[0].detach().clone())  # a tied copy: scaled, not counted
    copy.grad = params[0].grad.clone()
    reference = [p.grad.clone() for p in params]
    expected = torch.nn.utils.clip_grad_norm_([_with_grad(g.clone()) for g in reference], 0.5)
    total = clip_grad_norm_global([*params, copy], 0.5, None, None, not_counted={id(copy)})
    assert abs(total.item() - expected.item()) <= 1e-6 * expected.item()
    for p, r in zip(params, reference):
        assert torch.allclose(p.grad, r * (0.5 / (expected + 1e-6)), rtol=1e-6, atol=0)
    assert torch.equal(copy.grad, params[0].grad)


def _with_grad(grad):
    import torch

    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad
    return p


def test_world_size_not_divisible_fails_before_launch():
    with pytest.raises(ValueError, match="pipeline_parallel=2 must divide the world size 3"):
        Trainer(accelerator="cpu", devices=3, strategy=BFPPStrategy(pipeline_parallel=2), logger=False)


def test_balanced_layout_minimises_heaviest_stage():
    assert balanced_stage_layers([10, 1, 1, 1, 1, 10], 3) == [1, 4, 1]
    assert balanced_stage_layers([1] * 8, 4) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="need at least as many layers"):
        balanced_stage_layers([1, 1], 3)


def test_split_keeps_global_names_and_removes_remote_layers():
    model = StackNet(n_blocks=6)
    full_keys = set(model.state_dict())
    local, names = split_stages(model, model.pipeline_layers(), 4, [1, 3], lambda s: s % 2, stage_layers=[2, 2, 2, 2])
    assert names == [["embed", "blocks.0"], ["blocks.1", "blocks.2"], ["blocks.3", "blocks.4"], ["blocks.5", "head"]]
    assert set(local[1].state_dict()) == {k for k in full_keys if k.startswith(("blocks.1.", "blocks.2."))}
    assert set(model.state_dict()) == set(local[1].state_dict()) | set(local[3].state_dict())
    assert isinstance(model.embed, RemoteLayer) and len(model.blocks) == 6
    with pytest.raises(RuntimeError, match="lives on another pipeline rank"):
        model.embed(None)
    # a new Trainer given the cut model (its other ranks' layers are placeholders) is refused, not cut again
    with pytest.raises(RuntimeError, match="already cut into pipeline stages by an earlier Trainer.*build a new model"):
        plan_stages(model, model.pipeline_layers(), 2)


def test_layout_and_parameter_coverage_errors():
    model = StackNet(n_blocks=2)
    with pytest.raises(ValueError, match="stage_layers=\\[1, 1\\] must list 2 positive layer counts"):
        split_stages(model, model.pipeline_layers(), 2, [0], lambda s: s, stage_layers=[1, 1])
    model.extra = nn.Linear(2, 2)  # a parameter outside every pipeline layer
    with pytest.raises(ValueError, match="not inside any of pipeline_layers"):
        split_stages(model, model.pipeline_layers(), 2, [0], lambda s: s)


def test_model_without_hooks_gets_a_clear_error():
    script = (
        "import torch, lightning as L, lightning_bfpp\n"
        "from torch.utils.data import DataLoader\n"
        "class M(L.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.l = torch.nn.Linear(2, 2)\n"
        "    def training_step(self, b, i): return self.l(b).sum()\n"
        "    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), 0.1)\n"
        "L.Trainer(accelerator='cpu', devices=1, strategy='bfpp', max_steps=1, logger=False)"
        ".fit(M(), DataLoader(torch.randn(4, 2), batch_size=2))\n"
    )
    res = subprocess.run([sys.executable, "-c", script], env=clean_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0
    assert "needs `M.pipeline_layers()`" in res.stderr


def test_package_exports():
    assert {"BFPPStrategy", "PipelineHooks", "ScheduleSpec", "build_schedule"} <= set(lightning_bfpp.__all__)


def test_batch_that_does_not_split_into_micro_batches_fails_before_the_first_step():
    from torch.utils.data import DataLoader

    with pytest.raises(ValueError, match="batch_size=6 .* not a multiple of micro_batches=4"):
        BFPPStrategy(pipeline_parallel=2, micro_batches=4).process_dataloader(DataLoader(range(12), batch_size=6))


def test_plan_stages_checks_the_model_without_changing_it():
    model = StackNet(n_blocks=2)
    before = dict(model.named_modules())
    assert plan_stages(model, model.pipeline_layers(), 2) == [["embed", "blocks.0"], ["blocks.1", "head"]]
    assert dict(model.named_modules()) == before
    with pytest.raises(ValueError,
                       match=r"stage_layers=\[2, 3\] .* summing to the 4 layers.*e.g. stage_layers=\[2, 2\]"):
        plan_stages(model, model.pipeline_layers(), 2, [2, 3])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pipeline_parallel": 2, "loops": 4}, r"8 stages \(pipeline_parallel x loops\) need at least as many layers"),
        ({"pipeline_parallel": 2, "stage_layers": [1, 1]}, r"stage_layers=\[1, 1\] .* summing to the 4 layers"),
        ({"pipeline_parallel": 2, "callbacks": "swa"},
         r"StochasticWeightAveraging does not work under strategy='bfpp'"),
    ],
)
def test_python_api_checks_the_model_before_any_process_starts(monkeypatch, kwargs, match):
    """`Trainer(devices=2).fit(model)`: the launcher checks the model in this process, before it starts the
    second one (in pytest that one would re-run pytest) and before any process group exists."""
    import time

    import torch.distributed as dist
    from exact_model import loader
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    def no_children(self):
        raise AssertionError("a child process was started")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", no_children)
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    callbacks = [StochasticWeightAveraging(swa_lrs=0.05)] if kwargs.pop("callbacks", None) == "swa" else []
    trainer = Trainer(accelerator="cpu", devices=2, strategy=BFPPStrategy(**kwargs), max_steps=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      callbacks=callbacks)
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        trainer.fit(StackNet(n_blocks=2), loader(8))
    assert time.monotonic() - start < 10
    assert not dist.is_initialized()


def test_rank_zero_only_work_in_last_stage_steps_is_named():
    """validation_step & co. run only on the last stage's ranks: rank-zero-only work there would run nowhere."""
    from lightning_bfpp.contract.source_notes import rank_zero_work_on_last_stage

    class Printing(StackNet):
        def validation_step(self, batch, batch_idx):
            if self.global_rank == 0:
                self.print("val", batch_idx)

    class Logging(StackNet):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self(batch[0]).sum())

    warning = rank_zero_work_on_last_stage(Printing(n_blocks=2), 2)
    assert "Printing.validation_step uses `self.print`; validation_step uses `global_rank`" in warning
    assert "pipeline rank 1 (the last stage), never on global rank 0" in warning
    assert rank_zero_work_on_last_stage(Printing(n_blocks=2), 1) is None  # one pipeline rank: every rank runs it
    assert rank_zero_work_on_last_stage(Logging(n_blocks=2), 4) is None  # self.log is replayed on every rank


def test_a_forward_that_is_not_the_pipeline_is_named():
    """bfpp never calls forward (training and self(x) are the pipeline layers in order): a forward that is not
    written with pipeline_forward/pipeline_layers gets a warning, the contract's own does not."""
    from lightning_bfpp.contract.source_notes import forward_not_the_pipeline

    class Scaled(StackNet):
        def forward(self, x):
            return 2 * self.head(self.embed(x))

    assert forward_not_the_pipeline(StackNet(n_blocks=2)) is None  # forward = self.pipeline_forward(x)
    warning = forward_not_the_pipeline(Scaled(n_blocks=2))
    assert "Scaled.forward is never called under strategy='bfpp'" in warning and "pipeline_forward(x)" in warning


def test_what_bfpp_runs_differently_is_named():
    """A user's own backward is never called, and batch normalization sees micro-batches: both get a warning."""
    from lightning_bfpp.contract.source_notes import not_run_as_written

    class Normed(StackNet):
        def __init__(self):
            super().__init__(n_blocks=2)
            self.blocks[0].norm = nn.BatchNorm1d(16)

        def backward(self, loss, *args, **kwargs):
            (2 * loss).backward()

    assert not_run_as_written(StackNet(n_blocks=2), micro_batches=4) == []
    backward, norm = not_run_as_written(Normed(), micro_batches=4)
    assert "Normed.backward is never called under strategy='bfpp'" in backward and "on_after_backward" in backward
    assert "batch normalization (blocks.0.norm)" in norm and "updates its running statistics 4 times per step" in norm
    assert len(not_run_as_written(Normed(), micro_batches=1)) == 1  # one micro-batch: the whole replica batch


def test_a_layer_of_another_rank_names_itself_when_its_attributes_are_used():
    """configure_optimizers writing param groups from layer attributes (self.inp.weight) runs on every rank: on a
    rank where the layer is a placeholder the error says where it lives and what to use instead."""
    from lightning_bfpp.layout.remote import RemoteLayer

    layer = RemoteLayer("inp", stage=0, rank=0)
    with pytest.raises(AttributeError, match=r"layer inp \(stage 0, pipeline rank 0\) lives on another pipeline rank: "
                                             r"`.weight` is not on this one.*self.named_parameters\(\)"):
        _ = layer.weight
    assert list(layer.parameters()) == [] and not hasattr(layer, "bias")


def test_default_pipeline_inputs_take_pairs_one_tuples_and_bare_inputs():
    """(x, y) trains; (x,) and a bare tensor x (prediction loaders) give target None; anything else names the hook."""
    import torch

    model = StackNet(n_blocks=2)
    x, y = torch.zeros(2, 16), torch.zeros(2, dtype=torch.long)
    assert model.pipeline_inputs((x, y)) == (x, y) and model.pipeline_inputs([x, y]) == (x, y)
    assert model.pipeline_inputs((x,)) == (x, None) and model.pipeline_inputs(x) == (x, None)
    with pytest.raises(TypeError,
                       match=r"got tuple\(float32\[2, 16\], int64\[2\], int64\[2\]\): define pipeline_inputs"):
        model.pipeline_inputs((x, y, y))


def test_training_step_logs_that_will_not_run_are_named():
    """training_step does not run under bfpp: what it logs (other than train_loss, or what
    pipeline_train_metrics logs too) is named in a warning instead of vanishing."""
    from lightning_bfpp.contract.source_notes import not_run_as_written

    class Logs(StackNet):
        def training_step(self, batch, batch_idx):
            loss = self.pipeline_loss(self(batch[0]), batch[1])
            self.log("train_loss", loss)
            self.log("grad_scale", 1.0)
            self.log_dict({"lr_now": 0.1})
            return loss

    class Moved(Logs):
        def pipeline_train_metrics(self, output, target):
            self.log("grad_scale", 1.0)

    [warning] = [w for w in not_run_as_written(Logs(n_blocks=2), 1) if "training_step" in w]
    assert "Logs.training_step logs grad_scale, self.log_dict(...), which will not be logged" in warning
    assert "pipeline_train_metrics" in warning and "train_loss," not in warning
    [warning] = [w for w in not_run_as_written(Moved(n_blocks=2), 1) if "training_step" in w]
    assert "grad_scale" not in warning
    assert not [w for w in not_run_as_written(StackNet(n_blocks=2), 1) if "training_step" in w]


def test_on_signal_settings_are_checked():
    with pytest.raises(ValueError, match="on_signal='later': use 'save'"):
        BFPPStrategy(on_signal="later")
    with pytest.raises(ValueError, match="signal_grace_s=0 must be a positive number of seconds"):
        BFPPStrategy(signal_grace_s=0)


def test_signal_grace_follows_the_launcher(monkeypatch):
    """What the launcher leaves before it kills: torchrun 30 s, SLURM's KillWait after SIGTERM; else 60 s."""
    import signal

    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    from lightning_bfpp.job.preempt import default_grace_s

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert default_grace_s(signal.SIGTERM, LightningEnvironment(), None) == 60
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert default_grace_s(signal.SIGTERM, LightningEnvironment(), None) == 25
    slurm = SLURMEnvironment()
    assert default_grace_s(signal.SIGTERM, slurm, signal.SIGUSR1) == 25
    assert default_grace_s(signal.SIGUSR1, slurm, signal.SIGUSR1) == 60


def test_optional_hooks_are_documented_methods_used_only_where_defined():
    """PipelineHooks documents each optional hook as a method (help() and docs/api.md show it); a module that does
    not define its own is treated as having none (no training metrics kept, tensor and context parallel refused by
    name), one that defines it (a subclass, or a duck-typed module) has it."""
    from lightning_bfpp import PipelineHooks
    from lightning_bfpp.contract.hooks import defined_hook

    hooks = ("pipeline_train_metrics", "pipeline_step_logs", "pipeline_tp_plan", "pipeline_context_parallel")
    assert all(getattr(PipelineHooks, h).__doc__ for h in hooks)

    class Plain(PipelineHooks, nn.Module):
        pass

    class Own(Plain):
        def pipeline_train_metrics(self, output, target):
            return None

    class DuckTyped(nn.Module):
        def pipeline_tp_plan(self, layer_name, layer, tensor_parallel, sequence_parallel=False):
            return None

    assert all(defined_hook(Plain(), h) is None for h in hooks)
    assert defined_hook(Own(), "pipeline_train_metrics") is not None and defined_hook(Own(), "pipeline_tp_plan") is None
    assert defined_hook(DuckTyped(), "pipeline_tp_plan") is not None
