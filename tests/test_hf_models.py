"""lightning_bfpp.hf.CausalLM on Hugging Face architectures beyond GPT-2 and Llama, in one process: its pipeline
layers give the model's own logits (sliding windows, attention types mixed per layer with their own rotary,
logit scaling and soft-capping, scaled embeddings), and a model whose forward does something they do not is
refused at construction instead of training a different model."""

from __future__ import annotations

import pytest
import torch
from exact_compare import assert_exact
from lightning.pytorch.plugins import DoublePrecision
from one_process import as_float64

transformers = pytest.importorskip("transformers",
                                   reason="lightning_bfpp.hf needs the [hf] extra: pip install -e '.[dev,hf]'")

from lightning_bfpp.hf import CausalLM, TypedDecoderLayer  # noqa: E402
from lightning_bfpp.layout.cut import plan_stages  # noqa: E402

transformers.logging.set_verbosity_error()
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, vocab_size=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW, SEQ = 4, 24  # sequences longer than the sliding window, so the window matters
ARCHITECTURES = {  # model_type: what its own forward does besides calling its modules, at these settings
    "mistral": dict(sliding_window=WINDOW),  # every layer sliding-window
    "phi3": dict(sliding_window=WINDOW),
    "starcoder2": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 0 full, then sliding
    "ministral": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "cohere2": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    logit_scale=0.3),  # mixed types, logits scaled
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        final_logit_softcapping=2.0),  # per-type rotary, soft-capped logits, scaled embedding
    "granite": dict(embedding_multiplier=6.0, logits_scaling=4.0, residual_multiplier=0.5),
    "cohere": dict(logit_scale=0.3),
}


def build(model_type: str, attn: str = "sdpa", **overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type,
                                               **{**SMALL, **ARCHITECTURES.get(model_type, {}), **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    for p in model.parameters():  # logits of order 10, so a missed scaling or soft-cap shows
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.5)
    return model


NEEDS_5 = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason=(
    "transformers 4's Gemma 3 layers take position_embeddings_global/_local: refused by CausalLM's check there"))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type",
                         [pytest.param(t, marks=NEEDS_5) if t == "gemma3_text" else t for t in ARCHITECTURES])
def test_the_pipeline_layers_give_the_models_own_logits(model_type, attn):
    model = as_float64(build(model_type, attn)).eval()  # float64: where rounding cannot decide (exact_compare)
    lm = CausalLM(model)
    ids = torch.randint(0, SMALL["vocab_size"], (3, SEQ), generator=torch.Generator().manual_seed(1))
    # as under Trainer(precision="64-true"): float64 the default dtype (the side inputs' cos/sin are made in it)
    with torch.no_grad(), DoublePrecision().forward_context():
        expected = model(ids).logits
        assert expected.abs().max() > 1  # large enough for the scalings to matter
        assert_exact(lm(ids), expected, "logits")


def test_layers_of_mixed_attention_types_keep_the_models_own_names():
    lm = CausalLM(build("ministral"))
    layers = lm.pipeline_layers()
    assert [layer.attention_type for layer in layers[1:-1]] == ARCHITECTURES["ministral"]["layer_types"]
    assert all(isinstance(layer, TypedDecoderLayer) for layer in layers[1:-1])
    names = plan_stages(lm, layers, 5)
    assert names == [["model.embed_tokens"], ["model.layers.0"], ["model.layers.1"], ["model.layers.2"],
                     ["model.norm", "lm_head"]]


class ScaledLlama(transformers.LlamaForCausalLM):
    """A model whose forward does something its modules do not (a user's subclass, or an architecture
    lightning_bfpp.hf does not know)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_a_model_whose_forward_does_more_than_its_layers_is_refused():
    model = ScaledLlama(transformers.LlamaConfig(**SMALL))
    model.train()
    with pytest.raises(ValueError,
                       match=r"ScaledLlama's pipeline layers do not reproduce its own forward .* check=False"):
        CausalLM(model)
    assert model.training  # the check puts the mode back
    CausalLM(model, check=False)  # the user's own risk


def test_layers_that_cannot_run_alone_are_refused_naming_the_model():
    model = build("llama")
    layer = model.model.layers[1]
    plain = layer.forward

    def forward(*args, **kwargs):  # a layer that needs an argument only the model's own forward passes
        if "cache" not in kwargs and "past_key_values" not in kwargs:
            raise RuntimeError("needs the whole model")
        return plain(*args, **kwargs)

    layer.forward = forward
    with pytest.raises(ValueError,
                       match=r"LlamaForCausalLM's layers cannot run one after another .*needs the whole model"):
        CausalLM(model)


def test_an_unknown_attention_type_is_named():
    model = build("qwen3_next", linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16,
                  linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                  shared_expert_intermediate_size=16,
                  layer_types=["linear_attention", "full_attention", "full_attention"])
    with pytest.raises(ValueError, match=r"attention type 'linear_attention'.*list its layers"):
        CausalLM(model)


def test_the_check_draws_no_random_numbers():
    model = build("llama")
    torch.manual_seed(5)
    CausalLM(model)
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), after)


def test_a_routed_mixture_of_experts_trains_its_router_loss():
    """output_router_logits=True: the layers carry routing statistics, the head keeps them for the loss (the router
    loss itself: tests/test_router_loss.py)."""
    lm = CausalLM(build("mixtral", num_local_experts=2, num_experts_per_tok=1, output_router_logits=True))
    assert lm.pipeline_uses_step_totals and type(lm.pipeline_layers()[-1]).__name__ == "RoutedHead"
    assert not CausalLM(build("mixtral", num_local_experts=2, num_experts_per_tok=1)).pipeline_uses_step_totals


def test_predict_step_takes_input_ids_alone_or_pairs():
    """Inference loaders yield input ids alone (a tensor, or TensorDataset(x)'s 1-tuples) or (input_ids, targets)
    pairs: CausalLM.predict_step gives the model's logits for each (under bfpp via pipeline_inputs(batch)[0])."""
    model = build("llama").eval()
    lm = CausalLM(model)
    ids = torch.randint(0, SMALL["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        for batch in (ids, (ids,), (ids, ids.roll(-1, 1))):
            torch.testing.assert_close(lm.predict_step(batch, 0), expected, rtol=0, atol=0)


# ---- tensor parallel by the model's own plan (in-process: the plans and their checks, no processes) ----
def _plans(model, tensor_parallel: int = 2, sequence_parallel: bool = False) -> dict[str, dict[str, str]]:
    from lightning_bfpp.layout.tensor_parallel import layer_plans

    lm = CausalLM(model)
    return {name: {k: type(v).__name__ for k, v in plan.items()}
            for name, _, plan in layer_plans(lm, lm.pipeline_layers(), tensor_parallel, sequence_parallel).values()}


def test_the_models_own_tensor_parallel_plan_becomes_torch_styles():
    plans = _plans(build("llama", num_key_value_heads=2))
    assert plans["model.embed_tokens"] == {"": "RowwiseParallel"}  # embedding_rowwise: vocabulary rows
    assert plans["model.layers.0"] == {"self_attn": "ReplicatedInput", "mlp": "ReplicatedInput",
                                       "self_attn.q_proj": "ColwiseParallel", "self_attn.k_proj": "ColwiseParallel",
                                       "self_attn.v_proj": "ColwiseParallel", "self_attn.o_proj": "RowwiseParallel",
                                       "mlp.gate_proj": "ColwiseParallel", "mlp.up_proj": "ColwiseParallel",
                                       "mlp.down_proj": "RowwiseParallel"}
    (head,) = [plan for name, plan in plans.items() if "OutputHead" in name]
    assert head == {"lm_head": "ColwiseParallel"}  # colwise_gather_output
    # tied embeddings stay whole; layers wrapped for mixed attention types keep their plan under the wrapper
    tied = _plans(build("qwen2", num_key_value_heads=2, tie_word_embeddings=True))
    assert "model.embed_tokens" not in tied and not [name for name in tied if "OutputHead" in name]
    mixed = _plans(build("ministral", num_key_value_heads=2))
    typed = [plan for name, plan in mixed.items() if "TypedDecoderLayer" in name]
    assert len(typed) == 3 and all(plan["layer.self_attn.q_proj"] == "ColwiseParallel" for plan in typed)


def test_sequence_parallel_gathers_the_sequence_for_the_split_projections_only():
    """With sequence parallel the norms run on each rank's shard; attention and MLP gather the sequence, their row-wise
    projections reduce-scatter it back; the embedding's output is cut into shards and the head gathers them."""
    plans = _plans(build("llama", num_key_value_heads=2), sequence_parallel=True)
    assert plans["model.embed_tokens"] == {"": "RowwiseParallel"}  # lookups summed straight into sequence shards
    assert plans["model.layers.0"] == {
        "self_attn": "ReplicatedInput", "mlp": "ReplicatedInput",
        "input_layernorm": "SequenceParallel", "post_attention_layernorm": "SequenceParallel",
        "self_attn.q_proj": "ColwiseParallel", "self_attn.k_proj": "ColwiseParallel",
        "self_attn.v_proj": "ColwiseParallel", "self_attn.o_proj": "RowwiseParallel",
        "mlp.gate_proj": "ColwiseParallel", "mlp.up_proj": "ColwiseParallel", "mlp.down_proj": "RowwiseParallel"}
    (head,) = [plan for name, plan in plans.items() if "OutputHead" in name]
    assert head == {"lm_head": "ColwiseParallel", "": "ReplicatedInput"}
    tied = _plans(build("qwen2", num_key_value_heads=2, tie_word_embeddings=True), sequence_parallel=True)
    assert tied["model.embed_tokens"] == {"": "PrepareModuleOutput"}  # whole, then cut to this rank's shard
    mixed = _plans(build("ministral", num_key_value_heads=2), sequence_parallel=True)
    typed = [plan for name, plan in mixed.items() if "TypedDecoderLayer" in name]
    assert all(p["layer.input_layernorm"] == "SequenceParallel" and p["layer.self_attn"] == "ReplicatedInput"
               for p in typed)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_a_decoder_layer_issues_the_collectives_the_simulator_counts(sequence_parallel):
    """A Llama decoder layer split by the model's own plan: two all-reduces per pass (attention's and the MLP's input
    gradients all-reduced once each, not per projection: five otherwise), or with sequence parallel an all-gather and
    a reduce-scatter for each, as the simulator counts."""
    from test_tensor_parallel import BLOCK_COLLECTIVES, collectives

    from lightning_bfpp.hf.side_inputs import causal_lm_side_inputs

    model = build("llama", num_key_value_heads=2)
    lm, layer = CausalLM(model), model.model.layers[0]
    plan = lm.pipeline_tp_plan("model.layers.0", layer, 2, sequence_parallel)
    side = causal_lm_side_inputs(model, torch.zeros(2, SEQ, dtype=torch.long))
    x = torch.randn(2, SEQ // 2 if sequence_parallel else SEQ, SMALL["hidden_size"])
    forward, backward = collectives(layer, plan, x, position_embeddings=side["position_embeddings"])
    assert forward == backward == BLOCK_COLLECTIVES[sequence_parallel]


def test_sequence_parallel_computes_a_block_the_plan_keeps_whole_on_the_gathered_sequence():
    """A decoder block holding weights the plan does not split (a router and experts, a norm over a gathered
    projection, a user's addition) runs whole on the gathered sequence, its output cut back to this rank's shard; a
    split block's row-wise projections reduce-scatter, those of a whole block all-reduce."""
    model = build("llama", num_key_value_heads=2)
    model.model.layers[0].adapter = torch.nn.Linear(SMALL["hidden_size"], SMALL["hidden_size"])  # e.g. a user's
    plan = _plans(model, sequence_parallel=True)["model.layers.0"]
    assert plan["adapter"] == "WholeBlock" and plan["self_attn"] == "ReplicatedInput"
    olmoe = CausalLM(build("olmoe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2))
    layer = olmoe.pipeline_layers()[1]
    plan = olmoe.pipeline_tp_plan("model.layers.0", layer, 2, sequence_parallel=True)
    assert type(plan["mlp"]).__name__ == type(plan["self_attn"]).__name__ == "WholeBlock"  # experts; q/k norms
    assert plan["self_attn.o_proj"].output_layouts == (torch.distributed.tensor.Replicate(),)


def test_weights_kept_whole_that_compute_with_split_heads_get_their_gradients_summed():
    """Apertus' MLP activation has weights of its own (xIELU) between the column- and the row-wise projection: its plan
    keeps them whole, so each rank's gradient is its share of the features, summed over tp (found by following the
    layer on the meta device). DeepSeek-V3's latent norms read whole tensors: they stay as they are."""
    plan = _plans(build("apertus", num_key_value_heads=2))["model.layers.0"]
    assert plan["mlp.act_fn"] == "SummedGradParameters" and plan["mlp"] == "ReplicatedInput"
    deepseek = _plans(build("deepseek_v3", num_key_value_heads=2, head_dim=4, q_lora_rank=16, kv_lora_rank=16,
                            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=2))
    layer = deepseek["model.layers.0"]
    assert layer["self_attn.kv_a_proj_with_mqa"] == "LatentProjection"
    assert "self_attn.q_a_layernorm" not in layer and "self_attn" not in layer  # whole: each projection sums its own


def test_a_weight_kept_whole_that_computes_both_ways_is_refused():
    class ScaledMLP(torch.nn.Module):  # `scale` multiplies the whole input and this rank's hidden units
        def __init__(self, width: int, hidden: int):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(width, hidden), torch.nn.Linear(width, hidden)
            self.down_proj = torch.nn.Linear(hidden, width)
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):
            return self.down_proj(self.gate_proj(x * self.scale) * self.up_proj(x) * self.scale)

    model = build("llama", num_key_value_heads=2)
    model.model.layers[0].mlp = ScaledMLP(SMALL["hidden_size"], SMALL["intermediate_size"])
    with pytest.raises(ValueError, match=r"tensor_parallel=2: LlamaForCausalLM's plan keeps mlp.scale whole, and it "
                                         r"computes both with this rank's share of a split projection and with whole "
                                         r"tensors"):
        _plans(model)


def test_sequence_parallel_refuses_a_decoder_child_split_outside_a_block():
    model = build("llama", num_key_value_heads=2)
    model.model.layers[0].adapter = torch.nn.Linear(SMALL["hidden_size"], SMALL["hidden_size"])
    model._tp_plan["model.layers.*.adapter"] = "colwise"
    with pytest.raises(ValueError, match=r"sequence_parallel=True: LlamaForCausalLM's decoder layer has adapter "
                                         r"\(Linear\) split as 'colwise' by the model's plan, outside an attention or "
                                         r"MLP block"):
        _plans(model, sequence_parallel=True)


@pytest.mark.parametrize("model_type, overrides, message", [
    ("llama", {}, r"tensor_parallel=2 must divide LlamaForCausalLM's num_attention_heads=2 and num_key_value_heads=1 "
                  r"\(each tensor-parallel rank computes whole query and key/value heads\); use tensor_parallel in "
                  r"\[1\]"),
    ("gpt2", {}, r"GPT2LMHeadModel has no tensor-parallel plan .* subclass CausalLM and return each layer's plan"),
    ("gemma3_text", {"num_key_value_heads": 2},
     r"tensor_parallel=2: Gemma3ForCausalLM's tensor-parallel plan splits model.layers.0.self_attn.q_norm as "
     r"'all_reduce', which lightning_bfpp cannot translate \(it knows colwise, .*\). Use tensor_parallel=1, or "
     r"subclass CausalLM and return this layer's plan from pipeline_tp_plan"),
])
def test_a_plan_that_cannot_run_is_refused_naming_the_rule(model_type, overrides, message):
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)) \
        if model_type == "gpt2" else build(model_type, **overrides)
    if model_type == "gemma3_text":  # a style transformers has, with no translation here
        model._tp_plan["model.layers.*.self_attn.q_norm"] = "all_reduce"
    with pytest.raises(ValueError, match=message):
        _plans(model)
