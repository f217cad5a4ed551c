"""stage_layers="auto" without processes: the time-balanced cut (pure arithmetic) and the per-layer timer
(leaves no trace on the model). The multi-process run is a config of tests/test_exactness.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from exact_model import StackNet, dataset

from lightning_bfpp.layout.layer_cost import (
    measure_layer_times,
    sample_micro_batch,
    stage_sums,
    time_balanced_stage_layers,
)
from lightning_bfpp.schedule.stage_cut import balanced_stage_layers


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_equal_times_cut_like_equal_weights(stages):
    times = [0.5] * 8
    assert time_balanced_stage_layers(times, stages) == balanced_stage_layers([1] * 8, stages)


def test_a_slow_head_gets_a_stage_of_its_own():
    times = [1.0] * 6 + [6.0]  # the last layer as slow as all the others together
    counts = time_balanced_stage_layers(times, 2)
    assert counts == [6, 1]
    assert stage_sums(times, counts) == [6.0, 6.0]


def test_cut_minimises_the_slowest_stage_over_every_cut():
    times = [0.3, 1.0, 0.2, 0.9, 0.4, 1.5, 0.1]
    best = min(max(stage_sums(times, [a, b, len(times) - a - b]))
               for a in range(1, len(times) - 1) for b in range(1, len(times) - a))
    assert max(stage_sums(times, time_balanced_stage_layers(times, 3))) == pytest.approx(best)


def test_measure_layer_times_leaves_no_trace():
    torch.manual_seed(0)
    model = StackNet()
    x, y = dataset()[:4]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    times = measure_layer_times(model, model.pipeline_layers(), x, y, model.pipeline_loss, torch.device("cpu"),
                                warmup=0, repeats=1)
    assert len(times) == len(model.pipeline_layers()) and all(t > 0 for t in times)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_sample_micro_batch_takes_rows_of_the_first_training_batch():
    model = StackNet()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8)
    source = SimpleNamespace(is_defined=lambda: True, dataloader=lambda: loader)
    inputs, target = sample_micro_batch(model, SimpleNamespace(fit_loop=SimpleNamespace(_data_source=source)), 4)
    assert inputs.shape[0] == target.shape[0] == 2
    with pytest.raises(ValueError, match="example_input_array"):
        sample_micro_batch(model, SimpleNamespace(), 4)
    model.example_input_array = dataset()[:4][0]
    inputs, target = sample_micro_batch(model, SimpleNamespace(), 2)
    assert inputs.shape[0] == 2 and target is None
