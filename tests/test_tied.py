"""Weights shared across stages, in one process: copies, gradient sums, norm counting, checkpoint aliases.
(Across pipeline ranks and with FSDP: tests/test_exactness.py, test_checkpoint.py, test_precision_memory.py.)"""

from __future__ import annotations

from itertools import chain

import torch
from exact_model import StackNet

from lightning_bfpp.layout.cut import split_stages
from lightning_bfpp.layout.tied import TiedWeights, find_shared_weights
from lightning_bfpp.schedule import ScheduleSpec
from lightning_bfpp.schedule.dims import ParallelDims


def _two_local_stages():
    model = StackNet(n_blocks=2, tied=True)
    layers = model.pipeline_layers()
    local, names = split_stages(model, layers, 2, [0, 1], lambda s: 0)
    shared = find_shared_weights(dict(zip(chain(*names), layers)), names)
    return model, shared, TiedWeights(model, shared, local, ParallelDims(world=1, spec=ScheduleSpec(loops=2)),
                                      global_rank=0)


def test_a_second_local_stage_gets_its_own_copy():
    model, shared, tied = _two_local_stages()
    assert shared == [{0: "embed.weight", 1: "unembed.weight"}]
    assert model.unembed.weight is not model.embed.weight and torch.equal(model.unembed.weight, model.embed.weight)
    assert tied.not_counted() == {id(model.unembed.weight)}  # the weight counts once in the gradient norm
    assert tied.aliases() == {"embed.weight": ["unembed.weight"], "unembed.weight": ["embed.weight"]}


def test_every_copy_gets_the_sum_of_the_copies_gradients():
    model, _, tied = _two_local_stages()
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    model.embed.weight.grad, model.unembed.weight.grad = a.clone(), b.clone()
    tied.sum_gradients()
    assert torch.equal(model.embed.weight.grad, a + b) and torch.equal(model.unembed.weight.grad, a + b)
    model.embed.weight.grad, model.unembed.weight.grad = a.clone(), None  # one use had no gradient: counts as 0
    tied.sum_gradients()
    assert torch.equal(model.unembed.weight.grad, a) and torch.equal(model.embed.weight.grad, a)
