"""A Hugging Face causal language model (GPT-2, and the Llama family: any model whose config has a
`base_model_pp_plan`) as ordered pipeline layers: its decoder layers as they are, or wrapped without being
registered (embedding, final norm + head, decoder layers of models that mix attention types), so stages and
checkpoints keep the model's own parameter names."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

ATTENTION_TYPES = ("full_attention", "sliding_attention")


class TokenEmbedding(nn.Module):
    """GPT-2's input: token + learned position embedding, then dropout (not registered: the model owns them)."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(input_ids) + self.wpe(position_ids))  # (B, T, D)


class ScaledEmbedding(nn.Module):
    """A token embedding times the model's ``config.embedding_multiplier`` (Granite)."""

    def __init__(self, embed: nn.Module, multiplier: float):
        super().__init__()
        self.embed, self.multiplier = embed, multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids) * self.multiplier


class OutputHead(nn.Module):
    """Final norm and vocabulary projection, then what the model's own forward does to the logits: Cohere's
    ``logit_scale`` (times), Granite's ``logits_scaling`` (divided by), Gemma's ``final_logit_softcapping``.
    Not registered: the model owns the modules."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, config: Any = None):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.multiplier = getattr(config, "logit_scale", None)
        self.divisor = getattr(config, "logits_scaling", None)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def forward(self, hidden_states: torch.Tensor, *_: Any) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden_states))  # (B, T, vocab)
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class TypedDecoderLayer(nn.Module):
    """A decoder layer of a model that mixes attention types (sliding-window and full layers: Gemma 3, Cohere 2,
    Ministral, ...): it takes the mask and rotary cos/sin of its own type. Not registered."""

    def __init__(self, layer: nn.Module, attention_type: str):
        super().__init__()
        self.layer, self.attention_type = layer, attention_type

    def forward(self, hidden_states: torch.Tensor, *, position_ids: torch.Tensor, per_attention_type: dict) -> Any:
        return self.layer(hidden_states, position_ids=position_ids, **per_attention_type[self.attention_type])


def attention_types(model: nn.Module) -> list[str]:
    """Each decoder layer's attention type, as the model's own forward picks its mask: ``config.layer_types``,
    else sliding for every layer when ``config.sliding_window`` is set (Mistral, Mixtral, Phi-3, Starcoder2)."""
    config = model.config
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"] * n
    unknown = sorted(set(types[:n]) - set(ATTENTION_TYPES))
    if unknown:
        raise ValueError(
            f"{type(model).__name__} has layers of attention type {unknown[0]!r}; lightning_bfpp.hf builds the masks "
            f"of {' and '.join(ATTENTION_TYPES)} layers only: list its layers and side inputs yourself "
            "(docs/huggingface.md)."
        )
    return list(types[:n])


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack: ``model.base_model``, or ``model.model`` where the former is the model itself (Gemma 3's
    text model in transformers 4.x)."""
    base = model.base_model
    return getattr(model, "model", base) if base is model else base


def causal_lm_layers(model: nn.Module) -> list[nn.Module]:
    """`model` (a ``*ForCausalLM``) as ordered pipeline layers: its decoder layers as they are (wrapped when they
    mix attention types), plus an input and an output layer wrapping its embedding and its final norm +
    ``lm_head``."""
    base, head, config = base_model(model), model.get_output_embeddings(), model.config
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head): pass a *ForCausalLM model.")
    if all(hasattr(base, n) for n in ("wte", "wpe", "h", "ln_f")):  # GPT-2 layout
        return [TokenEmbedding(base.wte, base.wpe, base.drop), *base.h, OutputHead(base.ln_f, head, config)]
    plan = getattr(config, "base_model_pp_plan", None)
    if not plan:
        raise ValueError(
            "lightning_bfpp.hf knows GPT-2 and models whose config has base_model_pp_plan (Llama, Mistral, Qwen2, "
            f"...); {type(model).__name__} has neither: list its layers in pipeline_layers() yourself "
            "(docs/huggingface.md)."
        )
    types = attention_types(model)
    mixed = len(set(types)) > 1
    *body, norm = [getattr(base, name) for name in plan]  # e.g. embed_tokens, layers, norm
    layers: list[nn.Module] = []
    for mod in body:
        if isinstance(mod, nn.ModuleList):
            decoders = list(mod[: config.num_hidden_layers])
            layers.extend([TypedDecoderLayer(d, t) for d, t in zip(decoders, types)] if mixed else decoders)
        elif getattr(config, "embedding_multiplier", 1.0) != 1.0:  # Granite scales the token embedding
            layers.append(ScaledEmbedding(mod, config.embedding_multiplier))
        else:
            layers.append(mod)
    return [*layers, OutputHead(norm, head, config)]
