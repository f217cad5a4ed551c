"""The loss rule without processes: a ``pipeline_loss`` returning ``(loss_sum, num_items)`` is trained as the mean over
every counted item of the global batch; a plain mean is averaged as before, with a warning when its targets hold
ignored values. (The runs against one process: tests/test_exactness.py and tests/test_hf_exact.py, "counted".)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_bfpp import mean_loss
from lightning_bfpp.adapter.training import TrainingStep
from lightning_bfpp.contract.hooks import loss_parts
from lightning_bfpp.runtime.pipeline import CountedLoss, StepLoss
from lightning_bfpp.runtime.reduce import share_loss
from lightning_bfpp.schedule.dims import ParallelDims


def test_mean_loss_takes_either_form_and_names_a_wrong_one():
    assert mean_loss((torch.tensor(6.0), torch.tensor(4))).item() == 1.5
    assert mean_loss(torch.tensor(0.25)).item() == 0.25
    assert loss_parts(torch.tensor(1.0))[1] is None
    with pytest.raises(TypeError, match=r"return a scalar loss \(a mean\), or \(loss_sum, num_items\)"):
        loss_parts((torch.tensor(1.0), 2, 3))


def test_counted_loss_hands_the_sum_to_backward_and_counts_by_the_returned_tensor():
    logits, target = torch.randn(6, 5), torch.tensor([0, -100, 2, -100, 4, 1])
    counted = CountedLoss(lambda o, t: (F.cross_entropy(o, t, ignore_index=-100, reduction="sum"), (t != -100).sum()))
    loss = counted(logits, target)
    assert loss.item() == pytest.approx(F.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item())
    assert counted.items == {id(loss): torch.tensor(4)}


def test_a_mean_loss_over_ignored_targets_is_named_once():
    counted = CountedLoss(lambda o, t: F.cross_entropy(o, t, ignore_index=-100))
    with pytest.warns(UserWarning, match=r"pipeline_loss returned a mean and its targets hold ignored values \(-100\)"):
        counted(torch.randn(4, 3), torch.tensor([0, -100, 1, 2]))
    assert counted.items == {}
    with warnings.catch_warnings():  # once: the first micro-batch of a run is looked at, no other
        warnings.simplefilter("error")
        counted(torch.randn(4, 3), torch.tensor([0, -100, 1, 2]))


def test_the_shared_loss_is_the_mean_over_counted_items_or_over_micro_batches():
    dims, cpu, f64 = ParallelDims(world=1), torch.device("cpu"), torch.float64
    loss, items = share_loss(StepLoss(torch.tensor(6.0, dtype=f64), torch.tensor(4)), dims, cpu)
    assert (loss.item(), items) == (1.5, 4.0)
    assert share_loss(StepLoss(torch.tensor(0.75), None), dims, cpu)[1] is None
    loss, items = share_loss(StepLoss(torch.tensor(0.0, dtype=f64), torch.tensor(0)), dims, cpu)
    assert (loss.item(), items) == (0.0, 0.0)  # a batch without counted targets adds nothing


def test_counted_gradients_are_divided_by_the_items_of_every_batch_since_the_last_step():
    """Two accumulated batches of 3 and 5 counted items, m=2 micro-batches, no data parallel: each batch's parked
    gradients (torch's 1/m scaling undone) add up, and the optimizer step sees their sum / 8."""
    step = TrainingStep(None, "stop", 5)
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([p], lr=1.0)
    for grad_of_sums, items in ((torch.tensor([3.0, 6.0]), 3.0), (torch.tensor([5.0, 10.0]), 5.0)):
        step.handover.fresh = [(p, grad_of_sums / 2)]  # as torch's runtime leaves it: divided by m=2
        step.counted, step.sum_scale = True, 2.0
        step.window_items = (step.window_items or 0.0) + items
        step.hand_over(accumulate_grad_batches=2)
    step.before_optimizer_step(optimizer)
    assert p.grad.tolist() == [1.0, 2.0] and step.window_items is None
    step.counted = False  # a plain mean: divided by the accumulated batches, as Lightning divides the loss
    p.grad = None
    step.handover.fresh = [(p, torch.tensor([4.0, 8.0]))]
    step.hand_over(accumulate_grad_batches=2)
    step.before_optimizer_step(optimizer)
    assert p.grad.tolist() == [2.0, 4.0]
