"""Context parallel (each rank holds 1/cp of every sequence; attention gathers keys and values over the cp group):
the example GPT (also over windows packing several documents) and Hugging Face causal LMs (Llama, Mistral's sliding
window, ...) train like one process (SGD, 3 steps, in float64: tests/exact_compare.py), a checkpoint reshards between
cp sizes, a pipeline message and a layer's gathered keys and values are what the simulator counts, the saved
activations per rank shrink as the simulator says, and bad settings are refused before launch, naming the setting.
Launches of tests/run_context.py: 4 processes (in `make test`), a wider matrix on 4 and 8 processes (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import run_tp
import torch
from exact_compare import ELEMENT_BYTES, assert_exact
from gpt import GPT, GPTConfig
from launch import ROOT, Launches, merged
from lightning.pytorch import Trainer

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.schedule import ScheduleSpec
from lightning_bfpp.schedule.dims import LayoutError, ParallelDims

pytest.importorskip("transformers", reason="the Hugging Face configs need the [hf] extra")

from references import gpt_reference, hf_micro_batches, hf_reference
from test_tensor_parallel import _compare, check_packed_documents

STEPS, BATCH = 3, 8

# name: config ("model": gpt | hf, then run_tp's or run_hf_exact's keys); HF models default to pp=2 x loops=2
# (embedding, 2 decoder layers, head); "packed": the example GPT on rows packing 2-4 documents (tests/packed_rows.py,
# the document-id batches of lightning_bfpp.contract.documents), checked against each document run alone
FAST = {
    "gpt-pp2-cp2": {"model": "gpt", "pp": 2, "cp": 2, "m": 2},
    "gpt-pp1-dp2-cp2": {"model": "gpt", "pp": 1, "cp": 2, "m": 2},
    "hf-llama-pp2-cp2": {"model": "hf", "family": "llama", "cp": 2},
    "hf-llama-pp1-dp2-cp2": {"model": "hf", "family": "llama", "cp": 2, "pp": 1, "m": 2},
    # every layer attends within a window of 4 tokens, shorter than a chunk (16 / 4): only chunk ends are gathered
    "hf-mistral-pp2-cp2": {"model": "hf", "family": "mistral", "cp": 2},
    "gpt-packed-pp2-cp2": {"model": "gpt", "packed": True, "pp": 2, "cp": 2, "m": 2},
    # the example's mixture of experts with its router loss: the routing statistics summed over every shard
    "gpt-moe-pp2-cp2": {"model": "gpt", "moe": True, "pp": 2, "cp": 2, "m": 2},
    # the saved activations of a cp=1 layout with the same micro-batches (its replica loads 8 samples too)
    "gpt-pp2-dp2-batch16": {"model": "gpt", "pp": 2, "m": 2, "batch": 16},
    # AdamW, 4 steps saving at step 2 at cp=2, resumed from step 2 at cp=1 (dp 2)
    "save-cp2": {"model": "gpt", "pp": 2, "cp": 2, "m": 2, "opt": "adamw", "steps": 4, "save_every": 2,
                 "save_dir": "{out}/cp2"},
    "resume-cp1": {"model": "gpt", "pp": 2, "m": 2, "opt": "adamw", "steps": 4, "resume": "{out}/cp2/step=2.ckpt"},
}
WIDE = {
    "hf-gemma3-pp2-cp2": {"model": "hf", "family": "gemma3", "cp": 2},  # sliding and full layers, soft-capped logits
    "hf-qwen2-pp2-cp2-kv2": {"model": "hf", "family": "qwen2", "cp": 2, "kv_heads": 2},  # tied embeddings
    "hf-gpt2-pp2-cp2": {"model": "hf", "family": "gpt2", "cp": 2},  # learned positions
    "hf-llama-eager-counted": {"model": "hf", "family": "llama", "cp": 2, "attn": "eager", "ignored": True},
    "hf-llama-pp1-cp4": {"model": "hf", "family": "llama", "cp": 4, "pp": 1, "m": 2},
    "gpt-pp2-loops2-cp2-ac-clip-tied-counted": {"model": "gpt", "pp": 2, "cp": 2, "loops": 2, "m": 2, "ac": True,
                                                "clip": 0.05, "tied": True, "ignored": True},
    "gpt-pp1-cp2-none": {"model": "gpt", "pp": 1, "cp": 2, "m": 2, "sharding": "none"},
    "gpt-pp2-cp2-1f1b": {"model": "gpt", "pp": 2, "cp": 2, "m": 4, "schedule": "1f1b"},
    "gpt-pp1-cp4": {"model": "gpt", "pp": 1, "cp": 4, "m": 2},  # 8 chunks of one token
    "gpt-packed-pp1-dp2-cp2": {"model": "gpt", "packed": True, "pp": 1, "cp": 2, "m": 2},
    "gpt-pp1-dp2-cp2-compile": {"model": "gpt", "pp": 1, "cp": 2, "m": 2, "compile": True},  # gathers run eagerly
}
WORLD8 = {
    "gpt-pp2-cp2-tp2-sp": {"model": "gpt", "pp": 2, "cp": 2, "tp": 2, "sp": True, "m": 2},
    "hf-llama-pp2-cp2-tp2-sp": {"model": "hf", "family": "llama", "cp": 2, "tp": 2, "sp": True, "kv_heads": 2},
    "gpt-pp2-loops2-cp2-tp2-ac-clip": {"model": "gpt", "pp": 2, "cp": 2, "tp": 2, "loops": 2, "m": 2, "ac": True,
                                       "clip": 0.05},
    "gpt-pp2-dp2-cp2": {"model": "gpt", "pp": 2, "cp": 2, "m": 2},
}
LAUNCHES = {"fast": (4, FAST), "wide": (4, WIDE), "world8": (8, WORLD8)}


def _plan(name: str, out: Path) -> tuple[int, dict[str, dict]]:
    devices, configs = LAUNCHES[name]
    return devices, {n: {k: v.format(out=out) if isinstance(v, str) else v for k, v in c.items()}
                     for n, c in configs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Launches:
    """tests/run_context.py, one launch per LAUNCHES entry: `runs(launch)[config name]`."""
    return Launches(tmp_path_factory, _plan, script=ROOT / "tests" / "run_context.py", timeout=900)


def _dp(devices: int, cfg: dict) -> int:
    default_pp = 2 if cfg["model"] == "hf" else 1
    return devices // (cfg.get("pp", default_pp) * cfg.get("cp", 1) * cfg.get("tp", 1))


def _check(records: list[dict], cfg: dict, devices: int) -> None:
    """Every rank's parameters and the logged losses against one process on the same data."""
    dp = _dp(devices, cfg)
    if cfg.get("packed"):
        check_packed_documents(records, dp)
        return
    if cfg["model"] == "gpt":
        ref = gpt_reference(STEPS, [dp] * STEPS, clip=cfg.get("clip"), tied=cfg.get("tied", False),
                            batch=cfg.get("batch", BATCH), ignored=cfg.get("ignored", False),
                            moe=cfg.get("moe", False))
        _compare(records, ref)
        return
    # under context parallel bfpp's attention function computes every layer's attention whatever the model's
    # attn_implementation; the reference's transformers "eager" takes its softmax in float32 (6e-9 off in float64),
    # "sdpa" computes the same attention in float64
    model, losses, _ = hf_reference(cfg["family"], dp, attn="sdpa", kv_heads=cfg.get("kv_heads", 1),
                                    ignored=cfg.get("ignored", False), micro_batches=hf_micro_batches(cfg, dp))
    params = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    got = merged(records)
    assert set(got) <= set(params) and got
    assert_exact(got, {n: params[n] for n in got}, "params")
    assert_exact(records[-1]["losses"], losses, "train_loss")


EXACT_RUNS = [("fast", n) for n, c in FAST.items() if "opt" not in c] + [("wide", n) for n in WIDE] + \
    [("world8", n) for n in WORLD8]


@pytest.mark.parametrize("launch, name", [(ln, n) if ln == "fast" else pytest.param(ln, n, marks=pytest.mark.slow)
                                          for ln, n in EXACT_RUNS], ids=[n for _, n in EXACT_RUNS])
def test_context_parallel_trains_exactly_as_one_process(runs, launch, name):
    devices, configs = LAUNCHES[launch]
    _check(runs(launch)[name], configs[name], devices)


def test_a_checkpoint_reshards_between_context_parallel_sizes(runs):
    """Weights and AdamW state saved at step 2 at cp=2 (pp2, dp1) continue at cp=1 (pp2, dp2) as if never interrupted:
    the resumed run and the uninterrupted one equal one process's 4 steps (the checkpoint's keys are the model's)."""
    saved, resumed = FAST["save-cp2"], FAST["resume-cp1"]
    dp_saved, dp_resumed = _dp(4, saved), _dp(4, resumed)
    _compare(runs("fast")["save-cp2"], gpt_reference(4, [dp_saved] * 4, opt="adamw"))
    ref = gpt_reference(4, [dp_saved] * 2 + [dp_resumed] * 2, opt="adamw")
    _compare(runs("fast")["resume-cp1"], (ref[0], ref[1][2:]))  # the resumed run logs steps 3 and 4


def _sim_layers(tensor_parallel: int = 1, sequence_parallel: bool = False, context_parallel: int = 1):
    from lightning_bfpp.sim import Model

    c = run_tp.model_config()
    return Model(c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size).layers(
        None, tensor_parallel, sequence_parallel, context_parallel)


@pytest.mark.parametrize("launch, name", [("fast", "gpt-pp2-cp2"),
                                          pytest.param("world8", "gpt-pp2-cp2-tp2-sp", marks=pytest.mark.slow)])
def test_messages_and_gathered_keys_are_what_the_simulator_counts(runs, launch, name):
    """A pipeline message carries the micro-batch's cp shard (with sequence parallel, / tp as well), and one attention
    layer all-gathers the whole sequence's keys and values (of this tp rank's heads): the simulator's message_bytes
    and kv_gather_bytes count the same (float64 here)."""
    from lightning_bfpp.sim import kv_gather_bytes, message_bytes

    devices, configs = LAUNCHES[launch]
    cfg = configs[name]
    tp, sp, cp = cfg.get("tp", 1), cfg.get("sp", False), cfg["cp"]
    layers = _sim_layers(tp, sp, cp)
    micro_batch = BATCH // _dp(devices, cfg) // cfg["m"]
    records = runs(launch)[name]
    senders = [r["message_bytes"] for r in records if r["message_bytes"]]
    expected = message_bytes(layers, micro_batch, tp, sp, activation_bytes=ELEMENT_BYTES)
    c = run_tp.model_config()
    assert expected == micro_batch * c.block_size // cp * c.n_embd * ELEMENT_BYTES // (tp if sp else 1)
    assert senders and all(b == expected for b in senders), (senders, expected)
    gathered = kv_gather_bytes(layers, micro_batch, activation_bytes=ELEMENT_BYTES)
    # keys and values, whole sequence
    assert gathered == 2 * micro_batch * c.block_size * c.n_embd // tp * ELEMENT_BYTES
    assert all(r["kv_gather_bytes"] == gathered for r in records)


def test_saved_activations_per_rank_shrink_with_context_parallel_as_the_simulator_says(runs):
    """The saved-activation peak per rank (the runtime's meter, the last step) at cp=2 against cp=1 with the same
    micro-batches, beside the simulator's ratio of the blocks' saved bytes: about 1/2, more by what attention keeps
    of the whole sequence (its gathered keys and values and its scores over all keys)."""
    from lightning_bfpp.sim import Model

    cp2 = [r["memory"]["activation_peak_bytes"] for r in runs("fast")["gpt-pp2-cp2"]]
    cp1 = [r["memory"]["activation_peak_bytes"] for r in runs("fast")["gpt-pp2-dp2-batch16"]]
    measured = max(cp2) / max(cp1)
    c = run_tp.model_config()
    model = Model(c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size)
    simulated = model._block_activation(1, 1, False, 2) / model._block_activation(1, 1, False, 1)
    print({"measured_cp2_over_cp1": round(measured, 3), "simulated_block_cp2_over_cp1": round(simulated, 3)})
    assert 0.45 <= measured <= 0.75, (cp2, cp1)
    assert abs(measured - simulated) <= 0.15, (measured, simulated)


# ---- settings refused before launch (no processes) ----
def test_context_parallel_must_be_a_count_and_fit_the_world():
    with pytest.raises(ValueError, match="context_parallel=0 must be a positive integer"):
        BFPPStrategy(context_parallel=0)
    with pytest.raises(LayoutError, match=r"context_parallel x tensor_parallel x pipeline_parallel = 3 x 1 x 2 must "
                                          r"divide the world size 4 .*use context_parallel in \[1, 2\]"):
        ParallelDims(world=4, spec=ScheduleSpec(pipeline_parallel=2), context_parallel=3).validate()
    with pytest.raises(ValueError, match="context_parallel x tensor_parallel x pipeline_parallel = 2 x 2 x 2"):
        Trainer(strategy=BFPPStrategy(pipeline_parallel=2, tensor_parallel=2, context_parallel=2), accelerator="cpu",
                devices=4, logger=False, enable_progress_bar=False)  # the world is known: before any process starts
    with pytest.raises(ValueError, match="layout='auto' searches context_parallel=1 only"):
        BFPPStrategy(layout="auto", global_batch_size=8, context_parallel=2)


def test_the_sequence_must_split_into_two_chunks_per_rank():
    dims = ParallelDims(world=4, spec=ScheduleSpec(pipeline_parallel=2), context_parallel=2).validate()
    assert dims.sequence_divisor == 4
    dims.check_sequence(8)
    with pytest.raises(LayoutError, match=r"context_parallel=2 splits every sequence into 2 x 2 = 4 chunks .* the "
                                          r"sequence length \(dim 1 of the first input\)=10 does not divide by 4"):
        dims.check_sequence(10)
    sp = ParallelDims(world=8, spec=ScheduleSpec(pipeline_parallel=1), context_parallel=2, tensor_parallel=4,
                      sequence_parallel=True).validate()
    assert sp.sequence_divisor == 8  # each rank's 2 chunks over tp=4: lcm(2 x 2, 2 x 4)
    with pytest.raises(LayoutError, match=r"each rank's 6 tokens over tensor_parallel=4"):
        sp.check_sequence(12)


def _refused_before_launch(monkeypatch, model, strategy: BFPPStrategy, match: str) -> None:
    """`Trainer(devices=2).fit(model)` raises in this process, before a second process or a process group exists."""
    import torch.distributed as dist
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    def no_children(self):
        raise AssertionError("a child process was started")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", no_children)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=match):
        trainer.fit(model, run_tp.DataLoader(run_tp.dataset(), batch_size=4))
    assert not dist.is_initialized()


def test_a_model_that_does_not_say_it_splits_is_refused_before_launch(monkeypatch):
    from exact_model import StackNet

    _refused_before_launch(monkeypatch, StackNet(n_blocks=2), BFPPStrategy(pipeline_parallel=1, context_parallel=2),
                           r"context_parallel=2 splits every sequence over 2 ranks, and StackNet does not say which of "
                           r"its layers run on a shard .*define StackNet.pipeline_context_parallel")

    class OwnAttention(GPT):  # a block whose attention is not split (its own SDPA call): named
        def pipeline_context_parallel(self, layer_name, layer, context_parallel):
            return not layer_name.startswith("blocks.")

    _refused_before_launch(monkeypatch, OwnAttention(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=8)),
                           BFPPStrategy(pipeline_parallel=1, context_parallel=2),
                           r"OwnAttention.pipeline_context_parallel\('blocks.0', ...\) returned False: layer blocks.0 "
                           r"\(Block\) would attend within its shard only")


def test_hugging_face_attention_that_cannot_be_split_is_refused_naming_the_layer():
    """A decoder layer whose attention computes attention itself (not through transformers' interface) is refused
    naming the layer; so is attention with soft-capped logits (Gemma 2). Llama is accepted and routed through bfpp's
    registered attention function, which outside context parallel is the model's own (the logits do not change)."""
    import run_hf_exact
    import torch.nn.functional as F
    import transformers
    from torch import nn

    from lightning_bfpp.hf import CausalLM
    from lightning_bfpp.layout.context_parallel import check_context_parallel

    lm = CausalLM(run_hf_exact.hf_model("llama"))
    x = torch.randint(0, run_hf_exact.VOCAB, (2, run_hf_exact.SEQ))
    before = lm(x)
    check_context_parallel(lm, lm.pipeline_layers(), 2)
    assert lm.hf_model.config._attn_implementation == "lightning_bfpp_cp_sdpa"
    torch.testing.assert_close(lm(x), before, atol=0, rtol=0)

    class HandWrittenAttention(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, **kwargs):
            q = k = v = hidden_states[:, None]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0], None

    model = run_hf_exact.hf_model("llama")
    model.model.layers[0].self_attn = HandWrittenAttention(model.model.layers[0].self_attn)
    lm = CausalLM(model, check=False)
    with pytest.raises(LayoutError, match=r"layer model.layers.0 \(LlamaDecoderLayer\) cannot run on a shard .*"
                                          r"self_attn \(HandWrittenAttention\) computes attention itself"):
        check_context_parallel(lm, lm.pipeline_layers(), 2)
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=64, attn_logit_softcapping=50.0))
    lm = CausalLM(gemma2, check=False)
    with pytest.raises(LayoutError, match=r"model.layers.0\).*soft-caps its attention logits"):
        check_context_parallel(lm, lm.pipeline_layers(), 2)
