"""Train tiny random-init Hugging Face causal LMs (lightning_bfpp.hf.CausalLM) under strategy=bfpp, several
layouts in one launch of N CPU processes; the reference is the plain HF model in one process (see test_hf_exact).

Usage: python tests/run_hf_exact.py OUT_DIR DEVICES '[{"family": "gpt2", "pp": 2, "loops": 2, "m": 2}, ...]' Config
keys: family (gpt2|llama|qwen2|mistral|gemma3|qwen3|olmo2|olmoe|mixtral|qwen3_moe|deepseek_v3: Mistral's layers attend
within a sliding window; Gemma 3 mixes sliding-window and full attention layers, each with its own rotary cos/sin,
scales its embedding and soft-caps its logits; Mixtral and Qwen3-MoE train their router loss; DeepSeek-V3 has a shared
expert beside its routed ones and latent attention; see hf_model), tie (tied embeddings; default: the family's own),
attn (sdpa|eager), kv_heads (default 1), tp (tensor parallel, the model's own plan), sp (sequence parallel), cp (context
parallel), pp, loops, m, steps, batch (global), precision (default "64-true": tests/exact_compare.py), ac
(activation_checkpointing), ignored (prompt and padding targets of -100 in every row), accumulate
(accumulate_grad_batches), lora (LoRA adapters: lora_model), adamw (AdamW, not SGD), save (checkpoint folder written
after fit), pretrained (a save_pretrained directory: CausalLM.from_pretrained, built on the meta device), packed (rows
packing 2-4 documents, tests/packed_rows.py: token batches with document ids; after fit the logits of the first
`batch` rows are predicted, "predicted", each data-parallel replica r of dp its rows r, r + dp, ...: "replica" (r,
dp)), ep (expert_parallel), schedule, router_loss (a mixture's: batch|micro_batch, given to BFPPStrategy as given; the
tests' reference reads the config's value). Rank R of config i writes
OUT_DIR/cfg{i}/rank{R}.pt = {"params": {name: full tensor}, "losses": [...], "tp_split": [names of the parameters split
over tensor-parallel ranks], "message_bytes": the largest activation message it sent, "expert_bytes": bytes of the
experts' weights it holds, "expert_state_bytes": their optimizer state, "trained_bytes", "grad_bytes", "state_bytes":
this rank's bytes of parameters that train, of gradients and of optimizer state, "frozen_in_optimizer": frozen
parameters the optimizer holds}."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import exact_model
import torch
import torch.nn.functional as F
from exact_compare import PRECISION
from lightning.pytorch import Callback, Trainer
from packed_rows import PackedRows
from torch.utils.data import DataLoader, TensorDataset

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.hf import CausalLM
from lightning_bfpp.layout.experts import experts_modules
from lightning_bfpp.layout.tensor_parallel import tp_sharded
from lightning_bfpp.runtime.instrument import local_bytes

VOCAB, SEQ, WIDTH, SAMPLES, LR = 64, 16, 32, 64, 0.5
# the mixtures of experts: 2 of 4 experts per token, the router loss on (output_router_logits)
ROUTER = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.5}
MIXTURES = ("olmoe", "mixtral", "qwen3_moe", "deepseek_v3")


def hf_model(family: str, tie: bool | None = None, attn: str = "sdpa", seed: int = 0, kv_heads: int = 1):
    """A tiny random-init model, built locally (2 layers, width 32, 2 query heads, vocab 64, no dropout)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                      tie_word_embeddings=True if tie is None else tie, attn_implementation=attn)
        return transformers.GPT2LMHeadModel(cfg)
    common = dict(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=2,
                  num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=SEQ, attn_implementation=attn)
    if tie is not None:
        common["tie_word_embeddings"] = tie
    families = {  # besides the common sizes; the family's own default for tied embeddings unless `tie`
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),  # ties its embeddings
        "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": SEQ // 4}),  # every layer sliding
        # sliding-window and full attention layers, each with its own rotary cos/sin, a scaled embedding, soft-capped
        # logits, q/k norms over heads
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                   {"head_dim": 16, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": SEQ // 4,
                    "final_logit_softcapping": 5.0, "tie_word_embeddings": True}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),  # q/k norms over heads
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # q/k norms over the whole projection
        # no base_model_pp_plan: its layers found from the model's layer list; experts kept whole under tensor parallel
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"intermediate_size": WIDTH // 2, "num_experts": 4,
                                                      "num_experts_per_tok": 2}),
        # mixtures of 4 experts, 2 per token, with the router loss on (Mixtral:
        # stored by transformers 5 one expert per key under older names (block_sparse_moe.experts.E.w1), fused in the
        # model (mlp.experts.gate_up_proj)
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, **ROUTER}),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": WIDTH,
                                                                "head_dim": 16, **ROUTER}),
        # 4 routed experts (2 per token) and a shared one; multi-head latent attention
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                        {"moe_intermediate_size": WIDTH, "n_routed_experts": 4,
                         "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                         "first_k_dense_replace": 0, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                         "qk_nope_head_dim": 8, "v_head_dim": 16}),
    }
    config, model, extra = families[family]
    if family == "gemma3":
        norms_in_the_inputs_type(transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm)
    return getattr(transformers, model)(getattr(transformers, config)(**{**extra, **common, **experts_kwargs(family)}))


# LoRA adapters (peft) on Llama's attention and MLP projections: column-wise (q, v, gate) and row-wise (o, down) ones
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]}


def lora_model(family: str, **kwargs):
    """hf_model(family, **kwargs) with LoRA adapters (``LORA``; peft's ``get_peft_model``). PEFT starts B at zero,
    which leaves A's gradient zero in the first step: B is drawn here (seed 1), so that every adapter weight trains
    from the first step."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf_model(family, **kwargs), LoraConfig(**LORA))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.2)
    return model


def norms_in_the_inputs_type(norm_class: type) -> None:
    """Gemma 3's RMSNorm (transformers' Gemma3RMSNorm) computes in float32 whatever its input's type, so in a float64
    run its weight's gradient is a float32 sum over the tokens; under sequence parallel each rank sums its own tokens,
    rounding at float32 (~1e-8) where the reference sums all of them. The same formula in at least float32 (float64
    here, float32 as before for float32 and bf16) lets the float64 comparison see the layout, not float32 rounding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        return (self._norm(x.to(dtype)) * (1.0 + self.weight.to(dtype))).type_as(x)

    norm_class.forward = forward


def experts_kwargs(family: str) -> dict:
    """Config fields a mixture of experts is built or loaded with: torch's grouped_mm (transformers' default experts
    kernel) has no float64 kernel, so the exactness runs (float64) use transformers' loop over the experts, "eager"
    (the same math); bfpp runs the experts module's own forward either way."""
    return {"experts_implementation": "eager"} if family in MIXTURES else {}


def load_balancing_loss64(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (no attention mask) in float64: transformers 5 sums the router
    probabilities in float32, which a float64 reference cannot use. Every layer's router logits together: the number
    of experts times the sum over experts of (the fraction of top-k picks it gets) x (its mean router probability)."""
    probs = torch.softmax(torch.cat(router_logits), dim=-1)  # (layers x tokens, E)
    num_experts = probs.shape[-1]
    picks = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, num_experts).to(probs.dtype)  # (rows, k, E)
    return num_experts * torch.sum(picks.mean(0) * probs.mean(0))


def dataset(ignored: bool = False) -> TensorDataset:
    """(input_ids, next tokens); `ignored`: each row's prompt and padding, of random lengths, have -100 targets (not
    counted by the loss), as fine-tuning data has, so rows and micro-batches count different numbers of targets."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    targets = tokens[:, 1:].clone()
    if ignored:
        prompt = torch.randint(0, SEQ // 2, (SAMPLES, 1), generator=g)
        padding = torch.randint(0, SEQ // 4, (SAMPLES, 1), generator=g)
        position = torch.arange(SEQ)
        targets[(position < prompt) | (position >= SEQ - padding)] = -100
    return TensorDataset(tokens[:, :-1], targets)


def lightning_batches(global_batch: int, data_parallel: int, ignored: bool = False):
    """The global batches Lightning's training sampler (shuffled, seed 0) yields, replicas concatenated."""
    return exact_model.lightning_batches(global_batch, data_parallel, dataset(ignored))


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


class Losses(Callback):
    def __init__(self):
        self.losses: list[float] = []
        self.aux_losses: list[float] = []  # a mixture of experts' router loss (train_aux_loss)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        if "train_aux_loss" in trainer.callback_metrics:
            self.aux_losses.append(float(trainer.callback_metrics["train_aux_loss"]))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def run(cfg: dict, devices: int, out: Path) -> None:
    sgd_or_adamw = adamw if cfg.get("adamw") else sgd
    if cfg.get("pretrained"):  # a saved model, built on the meta device; each rank reads its own stages' tensors
        model = CausalLM.from_pretrained(cfg["pretrained"], optimizer=sgd, attn_implementation=cfg.get("attn", "sdpa"),
                                         **experts_kwargs(cfg["family"]))
    else:
        build = lora_model if cfg.get("lora") else hf_model
        model = CausalLM(build(cfg["family"], tie=cfg.get("tie"), attn=cfg.get("attn", "sdpa"),
                               kv_heads=cfg.get("kv_heads", 1)), optimizer=sgd_or_adamw)
    strategy = BFPPStrategy(pipeline_parallel=cfg.get("pp", 2), loops=cfg.get("loops", 2),
                            micro_batches=cfg.get("m", 2), tensor_parallel=cfg.get("tp", 1),
                            sequence_parallel=cfg.get("sp"), context_parallel=cfg.get("cp", 1),
                            activation_checkpointing=cfg.get("ac", False), expert_parallel=cfg.get("ep", 1),
                            schedule=cfg.get("schedule"), router_loss=cfg.get("router_loss"),
                            timeout=timedelta(seconds=120))
    record = Losses()
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=cfg.get("steps", 3),
                      precision=cfg.get("precision", PRECISION), accumulate_grad_batches=cfg.get("accumulate", 1),
                      logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[record])
    per_replica = cfg.get("batch", 8) // (devices // (cfg.get("pp", 2) * cfg.get("tp", 1) * cfg.get("cp", 1)))
    data = PackedRows(SAMPLES, SEQ, VOCAB) if cfg.get("packed") else dataset(cfg.get("ignored", False))
    trainer.fit(model, DataLoader(data, batch_size=per_replica, drop_last=True))
    predicted = None
    if cfg.get("packed"):  # the trained model's logits of packed rows (no labels), on the last stage's ranks
        rows = torch.utils.data.Subset(PackedRows(SAMPLES, SEQ, VOCAB, labels=False), range(cfg.get("batch", 8)))
        logits = trainer.predict(model, DataLoader(rows, batch_size=cfg.get("batch", 8)))
        predicted = torch.cat(logits) if logits and all(isinstance(o, torch.Tensor) for o in logits) else None
    if cfg.get("save"):
        trainer.save_checkpoint(cfg["save"])
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    out.mkdir(parents=True, exist_ok=True)
    split = sorted(n for n, p in model.named_parameters() if tp_sharded(p))  # split over the tensor-parallel ranks
    replica = strategy.distributed_sampler_kwargs  # predict: Lightning's sampler gives replica r rows r, r + dp, ...
    experts = [p for _, m in experts_modules(model) for p in m.parameters(recurse=False)]
    state = trainer.optimizers[0].state
    trained = [p for p in model.parameters() if p.requires_grad]
    state_tensors = (v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))
    frozen = sum(not p.requires_grad for g in trainer.optimizers[0].param_groups for p in g["params"])
    torch.save({"trained_bytes": local_bytes(trained), "grad_bytes": local_bytes(p.grad for p in model.parameters()),
                "state_bytes": local_bytes(state_tensors), "frozen_in_optimizer": frozen, "params": params,
                "losses": record.losses, "aux_losses": record.aux_losses, "tp_split": split, "predicted": predicted,
                "replica": (replica["rank"], replica["num_replicas"]),
                "message_bytes": strategy.runner.message_bytes, "expert_bytes": local_bytes(experts),
                "expert_state_bytes": local_bytes(v for p in experts for v in state.get(p, {}).values()
                                                  if isinstance(v, torch.Tensor))},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    from launch import run_configs

    run_configs(run)
