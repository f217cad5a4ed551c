"""A mixture-of-experts model's router loss (its own load_balancing_loss_func x router_aux_loss_coef) through
CausalLM, without processes: its value in one process, its gradient summed over micro-batches from the step's totals,
and the schedules and models it refuses. (Against one process in real pipelines: tests/test_hf_exact.py, "router".)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="lightning_bfpp.hf needs the [hf] extra: pip install -e '.[dev,hf]'")

from run_hf_exact import dataset, hf_model

from lightning_bfpp import BFPPStrategy, mean_loss
from lightning_bfpp.contract.step_totals import StepTotals, step_totals
from lightning_bfpp.hf import CausalLM

FAMILIES = ["mixtral", "qwen3_moe"]


def _one_process(family: str, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(the HF model's own loss: cross-entropy + coef x aux_loss, aux_loss, gradients) on the whole batch."""
    model = hf_model(family)
    out = model(x, output_router_logits=True)
    loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    loss = loss + model.router_aux_loss_coef * out.aux_loss
    loss.backward()
    return loss.item(), out.aux_loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_trains_the_models_own_loss_in_one_process(family):
    x, y = dataset(ignored=True)[0:8]
    loss, aux, grads = _one_process(family, x, y)
    lm = CausalLM(hf_model(family))
    value = lm.pipeline_loss(lm(x), y)
    mean_loss(value).backward()
    assert mean_loss(value).item() == pytest.approx(loss, rel=1e-6)
    assert set(dict(lm.named_parameters())) == set(grads)
    worst = max((p.grad - grads[n]).abs().max().item() for n, p in lm.named_parameters())
    assert worst <= 1e-6
    assert aux > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_micro_batches_reading_the_steps_totals_give_the_whole_batchs_gradient(family):
    """What a pipeline step computes, in one process: 4 micro-batches, each loss's router part adding its statistics
    to the step's totals and reading them in backward; the summed gradient divided by the counted targets (the loss
    rule) equals the whole batch's."""
    x, y = dataset(ignored=True)[0:8]
    _, _, grads = _one_process(family, x, y)
    lm = CausalLM(hf_model(family))
    totals = StepTotals()
    with step_totals(totals):
        parts = [lm.pipeline_loss(lm(xj), yj) for xj, yj in zip(x.chunk(4), y.chunk(4))]
        items = sum(int(n) for _, n in parts)
        torch.stack([loss for loss, _ in parts]).sum().backward()
    assert totals.total("items").item() == items == int((y != -100).sum())
    worst = max((p.grad / items - grads[n]).abs().max().item() for n, p in lm.named_parameters())
    assert worst <= 1e-6


def test_totals_read_before_every_forward_ran_are_refused():
    totals = StepTotals(needs_forwards_first="bfpp: schedule=1f1b starts a backward before the step's last forward")
    totals.add("items", torch.ones(1))
    with pytest.raises(RuntimeError, match="starts a backward before the step's last forward"):
        totals.total("items")


@pytest.mark.parametrize("schedule, groups", [("1f1b", 1), ("depth_first", 1), ("breadth_first_zb", 1),
                                              ("breadth_first", 2)])
def test_schedules_that_start_backward_early_are_refused_before_launch(schedule, groups):
    lm = CausalLM(hf_model("mixtral"))
    loops = 1 if schedule == "1f1b" else 2
    strategy = BFPPStrategy(pipeline_parallel=1, loops=loops, micro_batches=4, schedule=schedule, groups=groups)
    with pytest.raises(ValueError, match=rf"schedule='{schedule}' \(groups={groups}\) starts a backward before"):
        strategy.check_model(lm)
    BFPPStrategy(pipeline_parallel=1, loops=2, micro_batches=4).check_model(lm)  # breadth-first, one group: fine


def test_a_model_without_the_usual_router_loss_is_named():
    model = hf_model("llama")
    model.config.output_router_logits = True  # a dense model asked for a router loss
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has output_router_logits=True.*set output_router_logits"):
        CausalLM(model)
