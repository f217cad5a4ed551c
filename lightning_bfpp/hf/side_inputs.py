"""What a Hugging Face causal LM's own forward computes once and hands to every decoder layer (position ids,
rotary cos/sin, causal and sliding-window masks), recomputed per micro-batch as pipeline side inputs; under context
parallel for this rank's shard of every sequence (``contract.context_parallel``)."""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from ..contract.context_parallel import causal_mask, current, token_positions
from ..contract.documents import document_causal_mask, document_positions, split_documents
from .cp_attention import check_attention_routed, own_implementation
from .layers import attention_types, base_model

# attention kernels that are causal (and windowed, from the layer's own `sliding_window`) without a mask
MASK_FREE = ("flash_attention_2", "flash_attention_3")


def attention_mask(seq: int, window: int | None, implementation: str, dtype: torch.dtype,
                   device: torch.device, document_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """The mask the model's attention kernel needs for a causal sequence: none for flash attention (causal and
    windowed by itself; packed documents it reads from the position ids, as transformers' packed-sequence path) and for
    sdpa without a window or documents (``is_causal``); a boolean mask for sdpa (True: attend), (1, 1, T, T), or
    (B, 1, T, T) keeping each token within its document (`document_ids`); an additive one for eager attention."""
    if implementation in MASK_FREE or (window is None and document_ids is None and implementation == "sdpa"):
        return None
    if document_ids is None:
        document_ids = torch.zeros(1, seq, dtype=torch.long, device=device)
    allowed = document_causal_mask(document_ids, window)
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


@functools.cache
def _rotary_per_type(cls: type) -> bool:
    """Whether a rotary module class makes cos/sin per attention type (``forward(x, position_ids, layer_type)``):
    read once per class, not per micro-batch."""
    return "layer_type" in inspect.signature(cls.forward).parameters


def causal_lm_side_inputs(model: nn.Module, inputs: Any) -> dict[str, Any]:
    """What the model's own forward computes once and hands to every decoder layer: position ids, rotary cos/sin
    (in the default dtype: bf16 under precision='bf16-true') and the attention mask, per attention type when
    the layers mix types (then under ``per_attention_type``, read by ``TypedDecoderLayer``). `inputs`: the input ids,
    or (input ids, document ids) of packed documents: positions then restart at each document and attention stays
    within it (``contract.documents``). Under context parallel they are this rank's shard: positions are its tokens' in
    the whole sequence and masks are over the keys its attention gathers (bfpp's attention function,
    ``hf.cp_attention``, attends over them)."""
    input_ids, document_ids = split_documents(inputs)
    seq, device, dtype = input_ids.shape[1], input_ids.device, torch.get_default_dtype()
    position_ids = (token_positions(seq, device).unsqueeze(0) if document_ids is None  # (1, T)
                    else document_positions(document_ids))  # (B, T)
    sharded = current() is not None
    if sharded:
        check_attention_routed(model)
    config = model.config
    base = base_model(model)
    rotary = getattr(base, "rotary_emb", None)
    per_type_rotary = rotary is not None and _rotary_per_type(type(rotary))
    types = attention_types(model) if hasattr(config, "num_hidden_layers") else ["full_attention"]
    per_type: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(types):
        inputs: dict[str, Any] = {}
        if rotary is not None:
            x = torch.empty(0, dtype=dtype, device=device)
            inputs["position_embeddings"] = (rotary(x, position_ids, kind) if per_type_rotary
                                             else rotary(x, position_ids))
        window = config.sliding_window if kind == "sliding_attention" else None
        if sharded:  # plain causal: by positions in bfpp's attention function; a window or documents: this mask
            mask = causal_mask(seq, device, window, document_ids) if window or document_ids is not None else None
        else:
            mask = attention_mask(seq, window, own_implementation(model), dtype, device, document_ids)
        if mask is not None:
            inputs["attention_mask"] = mask
        per_type[kind] = inputs
    if len(per_type) > 1:
        return {"position_ids": position_ids, "per_attention_type": per_type}
    return {"position_ids": position_ids, **per_type[types[0]]}
