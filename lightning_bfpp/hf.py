# Scope: Hugging Face causal language models (GPT-2, and the Llama family: any model whose config has a
# `base_model_pp_plan`) as pipeline layers. The model's own modules are listed as they are (decoder layers),
# or wrapped without being registered (embedding, final norm + head), so stages and checkpoints keep the
# model's own parameter names. Needs `pip install lightning-bfpp[hf]`; nothing is downloaded.
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from .hooks import PipelineHooks

# attention kernels that are causal when no mask is given; "eager" gets an explicit causal mask
CAUSAL_WITHOUT_MASK = ("sdpa", "flash_attention_2", "flash_attention_3")


class TokenEmbedding(nn.Module):
    """GPT-2's input: token + learned position embedding, then dropout (not registered: the model owns them)."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(input_ids) + self.wpe(position_ids))  # (B, T, D)


class OutputHead(nn.Module):
    """Final norm and vocabulary projection (not registered: the model owns them)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden_states: torch.Tensor, *_: Any) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_states))  # (B, T, vocab)


def causal_lm_layers(model: nn.Module) -> list[nn.Module]:
    """`model` (a ``*ForCausalLM``) as ordered pipeline layers: its decoder layers as they are, plus an input
    and an output layer wrapping its embedding and its final norm + ``lm_head``."""
    base, head = model.base_model, model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head): pass a *ForCausalLM model.")
    if all(hasattr(base, n) for n in ("wte", "wpe", "h", "ln_f")):  # GPT-2 layout
        return [TokenEmbedding(base.wte, base.wpe, base.drop), *base.h, OutputHead(base.ln_f, head)]
    plan = getattr(model.config, "base_model_pp_plan", None)
    if not plan:
        raise ValueError(
            f"lightning_bfpp.hf knows GPT-2 and models whose config has base_model_pp_plan (Llama, Mistral, Qwen2, ...); "
            f"{type(model).__name__} has neither: list its layers in pipeline_layers() yourself (README: Hugging Face models)."
        )
    *body, norm = [getattr(base, name) for name in plan]  # e.g. embed_tokens, layers, norm
    layers: list[nn.Module] = []
    for mod in body:
        layers.extend(mod[: model.config.num_hidden_layers] if isinstance(mod, nn.ModuleList) else [mod])
    return [*layers, OutputHead(norm, head)]


def causal_lm_side_inputs(model: nn.Module, input_ids: torch.Tensor) -> dict[str, Any]:
    """What the model's own forward computes once and hands to every layer: position ids, rotary cos/sin (in
    the default dtype: bf16 under precision='bf16-true'), and a causal mask for eager attention."""
    seq, device = input_ids.shape[1], input_ids.device
    position_ids = torch.arange(seq, device=device).unsqueeze(0)  # (1, T)
    side: dict[str, Any] = {"position_ids": position_ids}
    rotary = getattr(model.base_model, "rotary_emb", None)
    dtype = torch.get_default_dtype()
    if rotary is not None:
        side["position_embeddings"] = rotary(torch.empty(0, dtype=dtype, device=device), position_ids)
    if model.config._attn_implementation not in CAUSAL_WITHOUT_MASK:
        blocked = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
        side["attention_mask"] = torch.zeros(seq, seq, dtype=dtype, device=device).masked_fill(
            blocked, torch.finfo(dtype).min)[None, None]  # (1, 1, T, T), additive
    return side


class CausalLM(PipelineHooks, LightningModule):
    """A Hugging Face ``*ForCausalLM`` as a pipelinable LightningModule, with the model's own state-dict keys.

    The model's top-level modules (``transformer``/``model``, ``lm_head``) are registered on this module itself,
    so ``state_dict()`` and checkpoints exported with ``python -m lightning_bfpp.checkpoint`` load into the plain
    Hugging Face class with ``load_state_dict(strict=True)``. Batches are ``(input_ids, targets)`` with targets
    already shifted (the next token; -100 is ignored). Tied embeddings become one copy per stage, kept identical.

    Args:
        model: e.g. ``GPT2LMHeadModel(config)`` or ``LlamaForCausalLM(config)`` (dropout draws differ per process).
        optimizer: parameters -> optimizer (default: AdamW, lr 3e-4).
    """

    def __init__(self, model: nn.Module, optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None):
        super().__init__()
        own = [n for n, _ in model.named_parameters(recurse=False)] + [n for n, _ in model.named_buffers(recurse=False)]
        if own:
            raise ValueError(f"{type(model).__name__} holds {own[0]} directly; CausalLM adopts its submodules only.")
        for name, child in model.named_children():
            if hasattr(self, name):
                raise ValueError(f"{type(model).__name__}.{name} clashes with LightningModule.{name}: wrap the model yourself.")
            self.add_module(name, child)
        self.__dict__["hf_model"] = model  # unregistered: its modules are registered above, under their own names
        self.__dict__["_layers"] = causal_lm_layers(model)
        self._optimizer = optimizer

    def pipeline_layers(self) -> list[nn.Module]:
        return self._layers

    def pipeline_side_inputs(self, input_ids: torch.Tensor) -> dict[str, Any]:
        return causal_lm_side_inputs(self.hf_model, input_ids)

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.pipeline_forward(input_ids)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, targets = batch
        loss = self.pipeline_loss(self(input_ids), targets)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        input_ids, targets = batch
        self.log("val_loss", self.pipeline_loss(self(input_ids), targets), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self._optimizer is not None:
            return self._optimizer(self.parameters())
        return torch.optim.AdamW(self.parameters(), lr=3e-4)
