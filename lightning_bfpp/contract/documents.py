"""Token batches, and documents packed into one window.

A token batch is a dict: ``input_ids`` (B, T), ``labels`` (B, T; the next token, -100 where no loss counts:
prompt tokens, padding, the boundary between packed documents) and, when a window packs several documents,
``document_ids`` (B, T; equal within a document, different across neighbours). ``PipelineHooks.pipeline_inputs``
turns it into ``(input_ids, labels)``, or ``((input_ids, document_ids), labels)``: the document ids reach every
stage's ``pipeline_side_inputs`` (they go to the first layer only if its forward takes a second positional
argument), which computes from them the positions that restart at each document (``document_positions``) and the
attention mask that keeps each token within its document (``document_causal_mask``)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .context_parallel import causal_mask, this_shard, whole_sequence

IGNORED = -100  # a target no loss counts, as PyTorch's and Hugging Face's cross-entropy
TOKEN_KEYS = ("input_ids", "labels", "document_ids")


def is_token_batch(batch: Any) -> bool:
    return isinstance(batch, Mapping) and "input_ids" in batch


def token_batch_inputs(batch: Mapping[str, torch.Tensor]) -> tuple[Any, torch.Tensor | None]:
    """(inputs, labels) of a token batch: inputs are ``input_ids``, or ``(input_ids, document_ids)`` when the batch
    packs documents; labels None when it has none (prediction)."""
    unknown = sorted(set(batch) - set(TOKEN_KEYS))
    if unknown:
        raise TypeError(f"a token batch holds {', '.join(TOKEN_KEYS)}; this one also holds {', '.join(unknown)}: "
                        "define pipeline_inputs(batch) -> (inputs, target) to read it.")
    documents = batch.get("document_ids")
    inputs = batch["input_ids"] if documents is None else (batch["input_ids"], documents)
    return inputs, batch.get("labels")


def split_documents(inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids, document_ids or None) of pipeline inputs: a tensor, or a tuple (input_ids, document_ids)."""
    if isinstance(inputs, (tuple, list)):
        return inputs[0], inputs[1] if len(inputs) > 1 else None
    return inputs, None


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True where a document starts (the first token of a row, and wherever the id changes)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids that restart at 0 at each document (and at the start of each row). Under context parallel
    (`document_ids`: this rank's shard of every sequence) the positions of this rank's tokens, counted over the whole
    sequences (``contract.context_parallel``)."""
    whole = whole_sequence(document_ids)
    index = torch.arange(whole.shape[1], device=whole.device).expand_as(whole)
    first = torch.where(document_starts(whole), index, torch.zeros_like(index)).cummax(dim=1).values
    return this_shard(index - first)


def document_causal_mask(document_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(B, 1, T, T) bool, True where a query (row) may attend to a key (column): keys up to the query, in the same
    document, and (`window`) among the last `window` positions, as a sliding-window layer. For the attention kernels'
    own masked paths (``F.scaled_dot_product_attention(attn_mask=...)``). Under context parallel, this rank's
    queries over the keys ``contract.context_parallel.attention`` gathers: one rule, ``causal_mask``'s."""
    return causal_mask(document_ids.shape[1], document_ids.device, window, document_ids)
