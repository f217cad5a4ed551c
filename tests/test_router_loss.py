"""A mixture-of-experts model's router loss (its own load_balancing_loss_func x router_aux_loss_coef) through
CausalLM, without processes, in float64 (tests/exact_compare.py): its value in one process, its gradient over
micro-batches from the step's totals (router_loss="batch": the whole batch's; "micro_batch": each micro-batch's own,
against tests/one_process.train on the same parts), the default each schedule gets, and the settings and models it
refuses. (Against one process in real pipelines: tests/test_hf_exact.py, "router", and tests/test_experts.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="lightning_bfpp.hf needs the [hf] extra: pip install -e '.[dev,hf]'")

from exact_compare import assert_exact
from one_process import as_float64, train
from references import hf_loss
from run_hf_exact import dataset, hf_model, load_balancing_loss64

from lightning_bfpp import BFPPStrategy, mean_loss
from lightning_bfpp.contract.router_loss import step_aux_loss
from lightning_bfpp.contract.step_totals import StepTotals, step_totals
from lightning_bfpp.hf import CausalLM

FAMILIES = ["mixtral", "qwen3_moe"]
PARTS = 4  # micro-batches of the 8-row batch


def _model(family: str):
    """The tiny HF mixture in float64 (hf_model: transformers' loop over the experts, the same math as grouped_mm,
    which has no float64 kernel)."""
    return as_float64(hf_model(family))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return dataset(ignored=True)[0:8]


def _reference(family: str, parts: int) -> tuple[list[tuple[float, int]], dict[str, torch.Tensor]]:
    """The HF model's own loss (cross-entropy + coef x aux_loss, float64) on the batch in `parts` micro-batches, each
    with its own aux_loss, the gradient over the counted targets (``one_process.train``, no optimizer step):
    ((aux_loss, counted targets) of each part, gradients)."""
    model = _model(family)
    auxes: list[tuple[float, int]] = []
    train(model, torch.optim.SGD(model.parameters(), lr=0.0), [[_batch()]], hf_loss(auxes), micro_batches=parts)
    return auxes, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_trains_the_models_own_loss_in_one_process(family):
    x, y = _batch()
    auxes, grads = _reference(family, 1)
    lm = CausalLM(_model(family))
    value = lm.pipeline_loss(lm(x), y)
    value[0].backward()  # divided by the counted targets after the backward, as bfpp and the reference divide
    for p in lm.parameters():  # (the model's router computes its softmax in float32: the order shows)
        p.grad.div_(value[1])
    model = _model(family)
    out = model(x, output_router_logits=True)
    expected = F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), ignore_index=-100) + \
        model.router_aux_loss_coef * load_balancing_loss64(out.router_logits, model.config.num_experts_per_tok)
    assert_exact(mean_loss(value), expected, "loss")
    assert set(dict(lm.named_parameters())) == set(grads)
    assert_exact({n: p.grad for n, p in lm.named_parameters()}, grads, "grads")
    assert auxes[0][0] > 0


def _pipeline_step(family: str, router_loss: str) -> tuple[CausalLM, StepTotals, int]:
    """What a pipeline step computes, in one process: PARTS micro-batches, each loss's router part adding to the
    step's totals (and, for "batch", reading them in backward); the summed gradient divided by the counted targets
    (the loss rule)."""
    x, y = _batch()
    lm = CausalLM(_model(family))
    totals = StepTotals(router_loss=router_loss)
    with step_totals(totals):
        parts = [lm.pipeline_loss(lm(xj), yj) for xj, yj in zip(x.chunk(PARTS), y.chunk(PARTS))]
        items = sum(int(n) for _, n in parts)
        torch.stack([loss for loss, _ in parts]).sum().backward()
    for p in lm.parameters():
        p.grad.div_(items)
    return lm, totals, items


@pytest.mark.parametrize("family", FAMILIES)
def test_micro_batches_reading_the_steps_totals_give_the_whole_batchs_gradient(family):
    auxes, grads = _reference(family, 1)
    lm, totals, items = _pipeline_step(family, "batch")
    assert_exact(totals.total("items"), [items], "items")
    assert items == int((_batch()[1] != -100).sum())
    assert_exact({n: p.grad for n, p in lm.named_parameters()}, grads, "grads")
    assert_exact(step_aux_loss(totals), auxes[0][0], "train_aux_loss")  # the whole batch's, logged after the step


@pytest.mark.parametrize("family", FAMILIES)
def test_router_loss_per_micro_batch_is_each_micro_batchs_own_weighted_by_its_items(family):
    """router_loss="micro_batch": each micro-batch's own load-balancing loss (the model's aux_loss on that
    micro-batch alone), weighted by its counted targets; no totals read in backward. Not the whole batch's."""
    auxes, grads = _reference(family, PARTS)
    lm, totals, items = _pipeline_step(family, "micro_batch")
    assert_exact({n: p.grad for n, p in lm.named_parameters()}, grads, "grads")
    assert_exact(step_aux_loss(totals), sum(a * n for a, n in auxes) / items, "train_aux_loss")
    whole, whole_grads = _reference(family, 1)
    router = next(n for n in grads if n.endswith("mlp.gate.weight"))
    assert (grads[router] - whole_grads[router]).abs().max() > 1e-6  # the two definitions differ
    assert abs(step_aux_loss(totals).item() - whole[0][0]) > 1e-6


def test_totals_read_in_backward_before_every_forward_ran_are_refused():
    totals = StepTotals(needs_forwards_first="bfpp: schedule=1f1b starts a backward before the step's last forward")
    totals.add("items", torch.ones(1))
    with step_totals(totals), pytest.raises(RuntimeError, match="starts a backward before the step's last forward"):
        totals.total("items")
    assert totals.total("items").item() == 1  # after the step (its logs): complete


@pytest.mark.parametrize("schedule, groups", [("1f1b", 1), ("depth_first", 1), ("breadth_first_zb", 1),
                                              ("breadth_first", 2), ("gpipe", 1), ("breadth_first", 1)])
def test_each_schedule_gets_the_router_loss_it_fits_said_once(schedule, groups):
    lm = CausalLM(hf_model("mixtral"))
    loops = 1 if schedule in ("1f1b", "gpipe") else 2
    strategy = BFPPStrategy(pipeline_parallel=1, loops=loops, micro_batches=4, schedule=schedule, groups=groups)
    strategy.check_model(lm)
    forwards_first = schedule == "gpipe" or (schedule, groups) == ("breadth_first", 1)
    assert strategy.router_loss == ("batch" if forwards_first else "micro_batch")
    assert strategy.plan.router_announced and strategy.plan.router_loss_line(lm) is None  # once
    fresh = BFPPStrategy(pipeline_parallel=1, loops=loops, micro_batches=4, schedule=schedule, groups=groups)
    line = fresh.plan.router_loss_line(lm)
    assert line.startswith(f"bfpp: router_loss={strategy.router_loss!r}: schedule={schedule} (groups={groups})")
    assert BFPPStrategy(pipeline_parallel=1).plan.router_loss_line(CausalLM(hf_model("llama"))) is None  # no router
    given = BFPPStrategy(pipeline_parallel=1, loops=loops, micro_batches=4, schedule=schedule, groups=groups,
                         router_loss="micro_batch")
    given.check_model(lm)  # micro_batch runs under every schedule
    assert given.router_loss == "micro_batch" and given.plan.router_loss_line(lm) is None  # given: nothing to say


@pytest.mark.parametrize("schedule, groups", [("1f1b", 1), ("depth_first", 1), ("breadth_first", 2)])
def test_the_whole_steps_router_loss_under_a_schedule_that_starts_backward_early_is_refused(schedule, groups):
    lm = CausalLM(hf_model("mixtral"))
    loops = 1 if schedule == "1f1b" else 2
    strategy = BFPPStrategy(pipeline_parallel=1, loops=loops, micro_batches=4, schedule=schedule, groups=groups,
                            router_loss="batch")
    with pytest.raises(ValueError, match=rf"router_loss='batch' .* schedule='{schedule}' \(groups={groups}\) starts a "
                                         r"backward before .*use router_loss='micro_batch'"):
        strategy.check_model(lm)


def test_a_bad_router_loss_is_refused_naming_the_values():
    with pytest.raises(ValueError, match=r"router_loss='step' must be 'batch' .*'micro_batch' .*or None"):
        BFPPStrategy(pipeline_parallel=1, router_loss="step")


def test_a_model_without_the_usual_router_loss_is_named():
    model = hf_model("llama")
    model.config.output_router_logits = True  # a dense model asked for a router loss
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has output_router_logits=True.*set output_router_logits"):
        CausalLM(model)
