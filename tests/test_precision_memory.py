"""Precision (bf16-mixed, bf16-true) and activation checkpointing under strategy=bfpp, at pp=2 x loops=2 x dp=2.

One 4-process launch trains StackNet (SGD, 6 steps) in ten settings; each is compared with the fp32 run
of the same launch, with the single-process SGD reference, or with its twin without checkpointing.
"""

from __future__ import annotations

import pytest
import torch
from exact_compare import assert_exact
from exact_model import reference, reference_eval
from launch import merged, run_lightning

STEPS, BATCH, DEVICES, DP = 6, 16, 4, 2
# bf16 vs fp32, per-step train_loss over 6 SGD steps (lr 0.5), relative to the fp32 loss. Measured max gaps:
# bf16-mixed 0.54% (FSDP MixedPrecisionPolicy) and 0.46% (autocast); bf16-true 0.82%. The gap grows with the
# steps as the two trajectories drift apart (0.25% max over the first 3 steps): bound ~4x the measurement.
BF16_MIXED_RTOL = 0.02
BF16_TRUE_RTOL = 0.03
# eval of the trained weights in bf16 vs a plain fp32 forward of the same weights: measured 0.07% (loss),
# 0.65% of max |output| (predictions).
EVAL_RTOL = 0.01

BASE = {"pp": 2, "loops": 2, "m": 2, "steps": STEPS}
CONFIGS = {
    "fp32": {**BASE, "precision": "32-true"},
    "fp64": {**BASE, "precision": "64-true"},  # the exactness runs' precision (tests/exact_compare.py)
    "bf16-mixed": {**BASE, "precision": "bf16-mixed", "eval": True},  # sharded: FSDP2 MixedPrecisionPolicy
    "bf16-mixed-autocast": {**BASE, "precision": "bf16-mixed", "sharding": "none"},  # unsharded: autocast
    "bf16-true": {**BASE, "precision": "bf16-true", "eval": True},
    "ac": {**BASE, "ac": True},  # float64 (run_exact's default): exact against the reference
    "ac-reshard": {**BASE, "ac": True, "reshard": True},
    "ac-bf16-mixed": {**BASE, "ac": True, "precision": "bf16-mixed"},
    "ac-bf16-mixed-autocast": {**BASE, "ac": True, "precision": "bf16-mixed", "sharding": "none"},
    "tied-bf16-mixed": {**BASE, "precision": "bf16-mixed", "tied": True, "ac": True},
}
NAMES = list(CONFIGS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ranks = run_lightning(tmp_path_factory.mktemp("precision"), DEVICES, list(CONFIGS.values()))
    return dict(zip(NAMES, ranks))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[n].double() - b[n].double()).abs().max().item() for n in a)


def _losses(ranks: list[dict]) -> list[float]:
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)  # logged loss: identical on every rank
    assert len(ranks[0]["losses"]) == STEPS
    return ranks[0]["losses"]


def _rel_gap(losses: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref))


def _dtypes(ranks: list[dict], key: str) -> set:
    return {tuple(x) if isinstance(x, (list, tuple)) else x for r in ranks for x in r["dtypes"][key]}


@pytest.mark.parametrize("name", ["bf16-mixed", "bf16-mixed-autocast"])
def test_bf16_mixed_keeps_fp32_weights_and_loss_within_tolerance_of_fp32(runs, name):
    ranks, fp32 = runs[name], runs["fp32"]
    gap = _rel_gap(_losses(ranks), _losses(fp32))
    print(f"{name}: max relative train_loss gap to fp32 over {STEPS} steps = {gap:.4%}")
    assert 0 < gap <= BF16_MIXED_RTOL
    assert {t.dtype for t in merged(ranks).values()} == {torch.float32}  # master weights
    assert {d for r in ranks for d in r["dtypes"]["grads"].values()} == {"torch.float32"}


def test_bf16_mixed_sharded_sends_bf16_and_reduces_fp32(runs):
    """FSDP2 MixedPrecisionPolicy: bf16 all-gathers and p2p (activations forward, gradients backward, and the
    forward-only eval/predict pipelines), fp32 gradient reduce-scatter, fp32 predictions (last stage)."""
    ranks = runs["bf16-mixed"]
    p2p = _dtypes(ranks, "p2p")
    assert {(mode, kind) for mode, _, kind, _ in p2p} == {("train", "act"), ("train", "grad"), ("predict", "act")}
    assert {stage for _, stage, _, _ in p2p} == {0, 1, 2, 3}
    assert {dtype for *_, dtype in p2p} == {"torch.bfloat16"}
    assert _dtypes(ranks, "fsdp") == {("all_gather", "torch.bfloat16"), ("reduce_scatter", "torch.float32")}
    # the fp32 run moves fp32 everywhere (the recording itself works)
    assert {dtype for *_, dtype in _dtypes(runs["fp32"], "p2p")} == {"torch.float32"}
    assert _dtypes(runs["fp32"], "fsdp") == {("all_gather", "torch.float32"), ("reduce_scatter", "torch.float32")}


def test_bf16_mixed_unsharded_uses_autocast(runs):
    """sharding="none": no FSDP; Lightning's autocast. StackNet's residual stream is bf16 under autocast
    (Linear -> tanh -> add), so its p2p is bf16 too; gradients are all-reduced in fp32 (fp32 .grad)."""
    ranks = runs["bf16-mixed-autocast"]
    assert _dtypes(ranks, "fsdp") == set()
    assert {dtype for *_, dtype in _dtypes(ranks, "p2p")} == {"torch.bfloat16"}


@pytest.mark.parametrize("name", ["bf16-mixed", "bf16-true"])
def test_bf16_validate_test_predict(runs, name):
    """Forward-only pipelines under bf16: val/test loss and predictions close to an fp32 forward of the same
    trained weights (predictions: fp32 from the last stage under bf16-mixed, bf16 under bf16-true)."""
    ranks = runs[name]
    state = {n: t.float() for n, t in merged(ranks).items()}
    val_ref, _ = reference_eval(state, DP, BATCH // DP, limit=2)
    test_ref, outputs_ref = reference_eval(state, DP, BATCH // DP)
    for rank, r in enumerate(ranks):
        assert abs(r["val_loss"] - val_ref) <= EVAL_RTOL * val_ref
        assert abs(r["test_loss"] - test_ref) <= EVAL_RTOL * test_ref
        if rank % DP == 0:
            expected = torch.float32 if name == "bf16-mixed" else torch.bfloat16
            assert r["predictions"].dtype == expected
            err = (r["predictions"].float() - outputs_ref).abs().max().item()
            assert err <= 2 * EVAL_RTOL * outputs_ref.abs().max().item(), err


def test_bf16_true_trains_in_bf16(runs):
    ranks = runs["bf16-true"]
    gap = _rel_gap(_losses(ranks), _losses(runs["fp32"]))
    print(f"bf16-true: max relative train_loss gap to fp32 over {STEPS} steps = {gap:.4%}")
    assert 0 < gap <= BF16_TRUE_RTOL
    assert {t.dtype for t in merged(ranks).values()} == {torch.bfloat16}
    assert {d for r in ranks for d in r["dtypes"]["grads"].values()} == {"torch.bfloat16"}
    assert {dtype for *_, dtype in _dtypes(ranks, "p2p")} == {"torch.bfloat16"}
    assert _dtypes(ranks, "fsdp") == {("all_gather", "torch.bfloat16"), ("reduce_scatter", "torch.bfloat16")}


@pytest.mark.parametrize("name", ["ac", "ac-reshard"])
def test_activation_checkpointing_matches_the_single_process_reference(runs, name):
    ranks = runs[name]
    ref_params, ref_losses = reference(STEPS, BATCH, DP)
    assert_exact(merged(ranks), ref_params, "params")
    assert_exact(_losses(ranks), ref_losses, "train_loss")
    assert_exact(merged(ranks), merged(runs["fp64"]), "params against the run without checkpointing")


@pytest.mark.parametrize("name", ["ac-bf16-mixed", "ac-bf16-mixed-autocast"])
def test_activation_checkpointing_under_bf16_mixed_changes_nothing(runs, name):
    twin = runs[name.removeprefix("ac-")]
    assert _max_diff(merged(runs[name]), merged(twin)) == 0.0  # the recomputed forward is the same computation
    assert _losses(runs[name]) == _losses(twin)


@pytest.mark.parametrize("precision", ["fp64", "bf16-mixed"])
def test_activation_checkpointing_cuts_saved_activation_bytes(runs, precision):
    """Peak saved-activation bytes per rank, without / with checkpointing. Expected from StackNet's layers
    (b rows of 16 floats per micro-batch): a Block saves its input, LayerNorm statistics, the normalised
    input and tanh's output (200·b bytes in fp32, twice that in fp64) and only its input (64·b, 128·b) when
    checkpointed: 3.125x; the
    rank holding the head also keeps the head's input and the loss's log-softmax (84·b) either way: 2.5x.
    Under bf16-mixed the normalised input and tanh's output are bf16 (136·b, plus the bf16 copy of fc's weight
    autocast makes): about 2.1-2.6x. Measured fp32: 3.12x (ranks 0, 1: stages 0 and 2) and 2.47x (ranks 2, 3:
    stages 1 and 3, with the head); bf16-mixed 2.59x and 2.37x. (A meter holding on to the tensors an op saves of
    its own output, past their graph, reads 3.65x in fp32.)"""
    key = "ac" if precision == "fp64" else "ac-bf16-mixed"
    without = runs[precision][0]["stats"]["memory"]
    with_ac = runs[key][0]["stats"]["memory"]
    factors = {rank: without[rank]["activation_peak_bytes"] / with_ac[rank]["activation_peak_bytes"]
               for rank in without}
    print(f"{precision}: saved-activation bytes per rank without / with checkpointing:",
          {rank: (without[rank]["activation_peak_bytes"], with_ac[rank]["activation_peak_bytes"], round(f, 2))
           for rank, f in factors.items()})
    no_head, head = (factors[0], factors[1]), (factors[2], factors[3])
    if precision == "fp64":
        assert all(abs(f - 3.125) <= 0.05 for f in no_head) and all(2.3 <= f <= 2.6 for f in head), factors
    else:
        assert all(2.1 <= f <= 2.8 for f in no_head) and all(2.0 <= f <= 2.6 for f in head), factors


# ---- no processes ----
def test_stage_module_checkpointing_keeps_names_and_gradients_and_saves_only_layer_inputs():
    from exact_model import StackNet

    from lightning_bfpp.layout.stage_module import StageModule

    torch.manual_seed(0)
    model = StackNet()
    named = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    x = torch.randn(8, 16, requires_grad=True)
    results = {}
    for ac in (False, True):
        stage = StageModule(named)
        stage.activation_checkpointing = ac
        saved = []

        def pack(t, saved=saved):
            if not isinstance(t, torch.nn.Parameter):
                saved.append(t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = stage(x)
        model.zero_grad()
        x.grad = None
        out.square().sum().backward()
        results[ac] = (list(stage.state_dict()), out.detach(), x.grad.clone(),
                       {n: p.grad.clone() for n, p in stage.named_parameters()}, sum(saved))
    (keys0, out0, gx0, g0, bytes0), (keys1, out1, gx1, g1, bytes1) = results[False], results[True]
    assert keys0 == keys1 and keys0[0] == "blocks.0.norm.weight"  # the model's own names
    assert torch.equal(out0, out1) and torch.equal(gx0, gx1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    assert bytes1 == 6 * 8 * 16 * 4  # one (8, 16) fp32 input per block
    assert bytes0 > 3 * bytes1
    with torch.no_grad():  # no recomputation set-up outside of autograd (eval, predict)
        assert torch.equal(stage(x), out0)


def test_app_applies_activation_checkpointing_once():
    """model.activation_checkpointing goes to BFPPStrategy under bfpp (the GPT blocks' own is off), and to the
    GPT blocks under strategy=auto."""
    from app.models import model_config
    from app.strategy import build_strategy
    from app_config import compose_app

    for strategy in ("bfpp", "auto"):
        cfg = compose_app(["model.activation_checkpointing=true", f"trainer.strategy={strategy}"])
        built = build_strategy(cfg)
        in_strategy = getattr(built, "activation_checkpointing", False)
        in_model = model_config(cfg).activation_checkpointing
        assert (in_strategy, in_model) == ((True, False) if strategy == "bfpp" else (False, True))


def test_tied_copies_stay_identical_under_bf16_mixed_and_checkpointing(runs):
    """The tied matrix's copies (first stage, last stage) get fp32 gradients summed in fp32: bit-identical."""
    ranks = runs["tied-bf16-mixed"]
    copies = [steps for r in ranks for steps in r["tied_history"].values()]
    assert len(copies) == DEVICES and all(len(c) == STEPS for c in copies)
    assert all(torch.equal(c[step], copies[0][step]) for c in copies for step in range(STEPS))
    assert copies[0][0].dtype == torch.float32


def test_activation_meter_lets_go_of_what_a_retained_graph_saved():
    """An op that saves its own output (log_softmax, softmax, attention) in a graph differentiated with
    retain_graph=True, as breadth_first_zb's input-gradient pass does: the meter's hold must not keep it alive once
    the graph is gone (a reference cycle through autograd's graph would keep it, growing every measured step)."""
    import gc

    from lightning_bfpp.runtime.instrument import SavedActivationMeter

    layer = torch.nn.Linear(8, 16)
    meter = SavedActivationMeter([layer])
    x = torch.randn(4, 8, requires_grad=True)
    with meter.track():
        loss = torch.nn.functional.cross_entropy(layer(x), torch.zeros(4, dtype=torch.long))
    (grad,) = torch.autograd.grad(loss, x, retain_graph=True)
    assert meter.current > 0
    del loss
    gc.collect()
    assert meter.current == 0 and meter.peak >= 4 * 16 * 4
