"""PipelineMetrics' per-step rates (Lightning's Throughput over the job's totals), without processes."""
from types import SimpleNamespace

import pytest
import torch

from lightning_bfpp.adapter.metrics import PipelineMetrics


def _trainer(world_size: int = 2, precision: str = "32-true"):
    return SimpleNamespace(world_size=world_size, precision=precision,
                           strategy=SimpleNamespace(root_device=torch.device("cpu")))


def test_rates_are_each_steps_own_and_mfu_divides_by_every_device():
    metrics = PipelineMetrics(flops_per_token=6.0, peak_flops=10.0)
    trainer = _trainer(world_size=2)
    first = metrics._rates(trainer, step_s=2.0, tokens=100, samples=4)
    assert first == pytest.approx({"tokens_per_s": 50.0, "model_flops_per_s": 300.0, "mfu": 300.0 / (10.0 * 2)})
    second = metrics._rates(trainer, step_s=0.5, tokens=100, samples=4)  # not averaged with the first step
    assert second == pytest.approx({"tokens_per_s": 200.0, "model_flops_per_s": 1200.0, "mfu": 1200.0 / 20.0})


def test_no_peak_on_cpu_means_no_mfu_and_no_flops_count_means_tokens_only():
    assert set(PipelineMetrics(flops_per_token=6.0)._rates(_trainer(), 1.0, 10, 2)) == {"tokens_per_s",
                                                                                       "model_flops_per_s"}
    assert PipelineMetrics()._rates(_trainer(), 1.0, 10, 2) == {"tokens_per_s": 10.0}
