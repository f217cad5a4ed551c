"""Context parallel for Hugging Face causal LMs: which layers run on a shard of every sequence, and the attention
function that lets them (registered with transformers' ``AttentionInterface``).

A decoder layer attends through the function its config names (``config._attn_implementation``, looked up in
``ALL_ATTENTION_FUNCTIONS`` at every call). Under ``BFPPStrategy(context_parallel>1)`` the model's implementation
becomes ``lightning_bfpp_cp_<its own>``: while a step runs on a shard (``contract.context_parallel.current()``) it
attends over the whole sequence (``contract.context_parallel.attention``: keys and values gathered, the mask by
positions, a sliding window's shorter gather), and otherwise it calls the model's own implementation unchanged, so
the model computes as before outside the pipeline. A layer whose attention does not go through the interface (its
class computes attention itself), or that soft-caps its attention logits or adds sink logits (which SDPA cannot), is
refused, named."""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch
from torch import nn

from ..contract.context_parallel import attention, current
from .layers import OutputHead, ScaledEmbedding, TokenEmbedding, TypedDecoderLayer

PREFIX = "lightning_bfpp_cp_"  # + the model's own implementation ("sdpa", "eager", "flash_attention_2", ...)
INTERFACE_CALL = "ALL_ATTENTION_FUNCTIONS"  # what an attention class's forward names when it uses the interface


def own_implementation(model: nn.Module) -> str:
    """The model's attention implementation, as it was before bfpp routed it (``use_context_parallel_attention``)."""
    return model.config._attn_implementation.removeprefix(PREFIX)


@functools.cache
def _uses_interface(cls: type) -> bool:
    """Whether an attention class's forward looks its attention function up in transformers' interface."""
    try:
        return INTERFACE_CALL in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _attention_modules(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention modules of a decoder layer, by transformers' naming (``*Attention``)."""
    return [(n, m) for n, m in layer.named_modules() if n and type(m).__name__.endswith("Attention")]


def splits_sequence(model: nn.Module, layer: nn.Module) -> bool:
    """Whether `layer` (one of ``layers.causal_lm_layers(model)``) runs right on a shard of every sequence; raises
    ValueError saying why a decoder layer cannot. Routes the model's attention through bfpp's function
    (``use_context_parallel_attention``) once a decoder layer is found to need it."""
    if isinstance(layer, (TokenEmbedding, ScaledEmbedding, OutputHead, nn.Embedding)):
        return True  # per token (GPT-2's position embedding takes the shard's position ids)
    decoder = layer.layer if isinstance(layer, TypedDecoderLayer) else layer
    found = _attention_modules(decoder)
    if not found:
        raise ValueError(f"{type(decoder).__name__} has no attention module (a *Attention submodule) that bfpp can "
                         "split over the sequence.")
    config = model.config
    for name, module in found:
        if not _uses_interface(type(module)):
            raise ValueError(f"its attention {name} ({type(module).__name__}) computes attention itself instead of "
                             "calling transformers' attention interface (ALL_ATTENTION_FUNCTIONS), so bfpp cannot "
                             "give it the keys and values of the whole sequence.")
        if any(isinstance(getattr(module, attr, None), torch.Tensor) for attr in ("sinks", "s_aux")):
            raise ValueError(f"its attention {name} adds sink logits, which the all-gathered attention (SDPA) "
                             "cannot.")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"{type(model).__name__} soft-caps its attention logits (attn_logit_softcapping), which "
                         "the all-gathered attention (SDPA) cannot.")
    if getattr(config, "reorder_and_upcast_attn", False) and own_implementation(model) == "eager":
        raise ValueError("reorder_and_upcast_attn=True computes eager attention outside the attention interface.")
    use_context_parallel_attention(model)
    return True


def use_context_parallel_attention(model: nn.Module) -> None:
    """Make `model` attend through ``lightning_bfpp_cp_<its implementation>`` (registered now): its own
    implementation outside a context-parallel step, the whole sequence's inside one."""
    from transformers import AttentionInterface

    own = own_implementation(model)
    name = PREFIX + own
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, functools.partial(_attend, own))
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


def check_attention_routed(model: nn.Module) -> None:
    """Raise when a context-parallel step runs a model whose attention is not bfpp's (its implementation changed
    after the strategy checked it): its layers would attend within their shard only."""
    if not model.config._attn_implementation.startswith(PREFIX):
        raise RuntimeError(
            f"context parallel: {type(model).__name__}'s attention implementation is "
            f"{model.config._attn_implementation!r}, not bfpp's {PREFIX}<implementation> (set when the strategy "
            "checked the model): its attention would see this rank's shard of the sequence only. Set the attention "
            "implementation before building the Trainer.")


def _attend(own: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
            sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, heads, T, head_dim), key and value (B, kv heads, T,
    head_dim) -> (output (B, T, heads, head_dim), no weights)."""
    if current() is None:  # the model's own implementation, as if bfpp were not there
        if own == "eager":
            function = sys.modules[type(module).__module__].eager_attention_forward
        else:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            function = ALL_ATTENTION_FUNCTIONS[own]
        window = {} if sliding_window is None else {"sliding_window": sliding_window}
        return function(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **window, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{type(module).__name__}: soft-capped or sink attention cannot be split over the sequence.")
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise TypeError("context parallel: an attention mask must be contract.context_parallel.causal_mask's "
                        f"(boolean, over the gathered keys); got {attention_mask.dtype}.")
    out = attention(query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None, dropout_p=dropout,
                    scale=scaling, enable_gqa=groups > 1, window=sliding_window)
    return out.transpose(1, 2).contiguous(), None

