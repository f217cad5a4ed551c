"""CUDA-graph capture of the stages' training passes (``cuda_graphs=True``) without a GPU: every setting it cannot
run with is refused naming it, before any process starts; a stage module with graphs installed runs eagerly
whenever it is not a training forward the runtime announced (evaluation, no grad, torch's shape inference). The
capture itself needs a GPU: benchmarks/device.sh runs it."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from user_module import Classifier, loader

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.runtime.cuda_graphs import StageGraphs, check_runtime_options
from lightning_bfpp.schedule import ScheduleSpec
from lightning_bfpp.schedule.dims import ParallelDims

ONE = ParallelDims(world=1, spec=ScheduleSpec(pipeline_parallel=1), sharding="none")
FSDP = ParallelDims(world=2, spec=ScheduleSpec(pipeline_parallel=1))  # data_parallel=2, sharded
TP = ParallelDims(world=2, spec=ScheduleSpec(pipeline_parallel=1), tensor_parallel=2)


@pytest.mark.parametrize("device, dims, extra, message", [
    ("cpu", ONE, {}, r"cuda_graphs=True \(Hydra: schedule.cuda_graphs=true\) needs a CUDA device: .* on cpu"),
    ("cuda", FSDP, {}, r"cannot run with sharding='full' over data_parallel=2: .*use sharding='none'"),
    ("cuda", TP, {}, r"cannot run with tensor_parallel=2"),
    ("cuda", ONE, {"activation_checkpointing": True}, r"cannot run with activation_checkpointing=True"),
])
def test_settings_cuda_graphs_cannot_run_with_are_named(device, dims, extra, message):
    with pytest.raises(ValueError, match=message):
        check_runtime_options(device, dims, compile_layers=False, cuda_graphs=True,
                              **{"activation_checkpointing": False, **extra})
    check_runtime_options("cuda", ONE, compile_layers=False, cuda_graphs=True, activation_checkpointing=False)


def test_a_cpu_run_with_cuda_graphs_fails_before_training_naming_the_setting(tmp_path):
    trainer = Trainer(accelerator="cpu", devices=1, strategy=BFPPStrategy(pipeline_parallel=1, cuda_graphs=True),
                      max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"cuda_graphs=True \(Hydra: schedule.cuda_graphs=true\) needs a CUDA device"):
        trainer.fit(Classifier(), train_dataloaders=loader(True, 8))


def test_stage_graphs_run_eagerly_outside_announced_training_forwards():
    layer = torch.nn.Linear(4, 4)
    eager = layer(torch.ones(2, 4))
    graphs = StageGraphs(layer)
    assert layer.forward is graphs and graphs.micro_batch is None
    assert torch.equal(layer(torch.ones(2, 4)), eager)  # no micro-batch announced: eager
    graphs.micro_batch = 0
    with torch.no_grad():
        assert torch.equal(layer(torch.ones(2, 4)), eager)  # no grad (evaluation, shape inference): eager
    layer.eval()
    assert torch.equal(layer(torch.ones(2, 4)), eager)  # evaluation mode: eager
    assert graphs.graphs == {}
