"""Context parallel as a model sees it: each rank holds a shard of every sequence, and attention sees the whole.

Under ``BFPPStrategy(context_parallel=N)`` every sequence of a batch is cut into 2N chunks along dim 1, and the
context-parallel rank i holds chunks i and 2N-1-i, concatenated (balanced for causal attention: each rank's queries see
as many keys, as in Megatron-LM and torchtitan). Every layer runs on that shard; a layer that mixes tokens must see
the others: ``attention`` (``F.scaled_dot_product_attention``'s arguments) all-gathers keys and values over the
context-parallel group with torch's autograd-aware collective (its backward sums their gradients back to the ranks
that computed them) and masks by the tokens' positions in the whole sequence. A model computes its positions with
``token_positions`` (rotary angles, position embeddings) and its masks with ``causal_mask`` (causal, sliding window,
packed documents: a mask is a function of the query's and the key's positions); both follow the shard the running step
holds (``current()``) and are the one-process values outside context parallel, so the same model code runs either way.

With a sliding window of w tokens a query sees only the w-1 keys before it: when that is shorter than a chunk, each
rank gathers only the last w-1 keys of every chunk (``gather_keys``): the gathered keys and values are
2 x cp x (w-1) tokens instead of the whole sequence.

May import nothing else of the package (the contract's rule); torch.distributed only when a shard is active.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

SEQUENCE_DIM = 1  # inputs, targets and the activations between layers: (batch, sequence, ...)


def chunk_positions(length: int, size: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Positions, in a sequence of `length` tokens, of the tokens context-parallel rank `rank` of `size` holds, in its
    order: chunk `rank`, then chunk 2 x size - 1 - rank, of the 2 x size equal chunks."""
    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


@dataclass(frozen=True)
class SequenceShard:
    """This rank's share of every sequence: `size` ranks of `group` (a torch ProcessGroup) share each, this is rank
    `rank` of them. `ring`: torch's ring attention for plain causal attention, where it runs (CUDA; None elsewhere),
    a function (query, key, value, scale, dropout_p) -> output of this rank's queries. `stats`: what its attention
    layers gathered (``kv_gather_bytes``: the most keys and values one layer's all-gathers assembled)."""

    size: int
    rank: int
    group: Any
    ring: Callable[..., torch.Tensor] | None = field(default=None, compare=False)
    stats: dict[str, float] = field(default_factory=dict, compare=False)

    def positions(self, local_length: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(local_length,) positions in the whole sequence of this rank's tokens."""
        return chunk_positions(local_length * self.size, self.size, self.rank, device)

    def split(self, whole: torch.Tensor, dim: int = SEQUENCE_DIM) -> torch.Tensor:
        """This rank's shard of a tensor holding whole sequences along `dim`."""
        return whole.index_select(dim, chunk_positions(whole.shape[dim], self.size, self.rank, whole.device))

    @torch.compiler.disable  # torch's autograd collectives refuse to be traced: a compiled layer runs this eagerly
    def gather(self, local: torch.Tensor, dim: int = SEQUENCE_DIM) -> torch.Tensor:
        """Every rank's `local` concatenated along `dim`, in rank order: an all-gather; differentiable for floating
        tensors, whose backward sends each rank the sum of its part's gradients over the group (a reduce-scatter).

        Both by torch's autograd-aware ``torch.distributed.nn.functional.all_to_all_single``: each rank sends its
        shard to every rank (the all-gather's bytes), and the backward returns the gradients the same way, summed.
        Not ``torch.distributed.nn.functional.all_gather``: on gloo (torch 2.13) its backward scatters from the
        group's rank numbers as if they were global ranks (it fails on any group but the first ranks) into buffers
        laid out like the incoming gradients (wrong sums for a non-contiguous one, as a slice of a concatenation)."""
        if local.is_floating_point() and local.requires_grad:
            from torch.distributed.nn.functional import all_to_all_single

            send = local.unsqueeze(0).expand(self.size, *local.shape).contiguous()  # (size, ...): one copy per rank
            received = all_to_all_single(torch.empty_like(send), send, group=self.group)  # [r]: rank r's shard
            return torch.cat(received.unbind(0), dim=dim)
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def whole(self, local: torch.Tensor, dim: int = SEQUENCE_DIM) -> torch.Tensor:
        """The whole sequences, in order, from every rank's shard `local` (not differentiable: for ids and masks)."""
        with torch.no_grad():
            gathered = self.gather(local.detach(), dim)
        order = torch.cat([chunk_positions(gathered.shape[dim], self.size, r, local.device) for r in range(self.size)])
        return gathered.index_select(dim, torch.argsort(order))


_ACTIVE: list[SequenceShard] = []  # the shard of the step running (a list: the backward may run on another thread)


@contextmanager
def sharding(shard: SequenceShard | None) -> Iterator[None]:
    """Within the block (a pipeline step: its forwards, backwards and recomputations), layers run on `shard`."""
    if shard is None:
        yield
        return
    _ACTIVE.append(shard)
    try:
        yield
    finally:
        _ACTIVE.pop()


def current() -> SequenceShard | None:
    """The shard of every sequence that the running step holds; None outside context parallel."""
    return _ACTIVE[-1] if _ACTIVE else None


def token_positions(local_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(local_length,) positions in the whole sequence of the tokens this rank holds (0..T-1 outside context
    parallel): for position embeddings and rotary angles."""
    shard = current()
    return shard.positions(local_length, device) if shard else torch.arange(local_length, device=device)


def this_shard(whole: torch.Tensor, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """This rank's shard of a tensor over whole sequences (itself outside context parallel)."""
    shard = current()
    return shard.split(whole, dim) if shard else whole


def whole_sequence(local: torch.Tensor, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """The whole sequences from every rank's shard (itself outside context parallel); not differentiable: for values
    computed over the whole sequence, such as positions restarting at each packed document (then ``this_shard``)."""
    shard = current()
    return shard.whole(local, dim) if shard else local


def _window_tail(local_length: int, window: int | None) -> int | None:
    """How many keys before each chunk a window of `window` tokens reaches, when fewer than a chunk (else None:
    attention needs every chunk whole)."""
    chunk = local_length // 2
    return window - 1 if window is not None and window - 1 < chunk else None


def _tails(t: torch.Tensor, dim: int, tail: int) -> torch.Tensor:
    """The last `tail` entries of each of a shard's two chunks along `dim`."""
    chunk = t.shape[dim] // 2
    return torch.cat([t.narrow(dim, chunk - tail, tail), t.narrow(dim, 2 * chunk - tail, tail)], dim=dim)


def gather_keys(local: torch.Tensor, dim: int, window: int | None = None) -> torch.Tensor:
    """The keys (or values, or their per-key ids) that this rank's queries attend to, from every rank's `local` along
    `dim`: all ranks' shards in rank order, or with a `window` shorter than a chunk this rank's own shard followed by
    the last window-1 entries of every rank's chunks (``key_positions`` gives their positions). Differentiable for
    floating tensors; `local` itself outside context parallel."""
    shard = current()
    if shard is None:
        return local
    tail = _window_tail(local.shape[dim], window)
    if tail is None:
        return shard.gather(local, dim)
    if tail == 0:
        return local
    return torch.cat([local, shard.gather(_tails(local, dim, tail), dim)], dim=dim)


def key_positions(local_length: int, device: torch.device | str | None = None,
                  window: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(positions of the keys ``gather_keys`` gives, in its order; which of them to attend to, or None for all): with
    a short window the copies of this rank's own chunk ends among the gathered ones are left out (its shard holds
    them already)."""
    shard = current()
    if shard is None:
        return torch.arange(local_length, device=device), None
    length = local_length * shard.size
    tail = _window_tail(local_length, window)
    if tail is None:
        return torch.cat([chunk_positions(length, shard.size, r, device) for r in range(shard.size)]), None
    own = shard.positions(local_length, device)
    if tail == 0:
        return own, None
    ends = [_tails(chunk_positions(length, shard.size, r, device), 0, tail) for r in range(shard.size)]
    keep = torch.ones(local_length + tail * 2 * shard.size, dtype=torch.bool, device=device)
    start = local_length + shard.rank * 2 * tail
    keep[start:start + 2 * tail] = False
    return torch.cat([own, *ends]), keep


def causal_mask(local_length: int, device: torch.device | str | None = None, window: int | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean attention mask (True: attend) of this rank's queries (rows) over the keys ``gather_keys`` gives
    (columns): keys up to the query; with `window`, only the last `window` positions (as transformers' sliding
    window: key > query - window); with `document_ids` (B, local_length; this rank's shard), only keys of the
    query's own packed document. Shape (1 or B, 1, queries, keys); outside context parallel the one-process mask."""
    queries = token_positions(local_length, device)
    keys, keep = key_positions(local_length, device, window)
    allowed = keys[None, :] <= queries[:, None]  # (queries, keys)
    if window is not None:
        allowed = allowed & (keys[None, :] > queries[:, None] - window)
    if keep is not None:
        allowed = allowed & keep[None, :]
    if document_ids is None:
        return allowed[None, None]
    key_documents = gather_keys(document_ids, SEQUENCE_DIM, window)
    return (allowed[None] & (document_ids[:, :, None] == key_documents[:, None, :]))[:, None]


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              window: int | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (query, key, value: (B, heads, T, head_dim)) over whole sequences when
    each rank holds a shard: keys and values gathered over the context-parallel group (``gather_keys``), the mask of
    this rank's queries over them (`is_causal`: ``causal_mask``; an `attn_mask` must be one of ``causal_mask``'s: over
    the gathered keys). `window`: the sliding window the mask was made with (the gathered keys then shorten). Plain
    causal attention runs torch's ring attention where it can (the shard's `ring`: CUDA). Outside context parallel,
    exactly ``F.scaled_dot_product_attention``."""
    shard = current()
    if shard is None:
        if window is not None and attn_mask is None and is_causal:
            attn_mask, is_causal = causal_mask(query.shape[-2], query.device, window), False
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if is_causal and attn_mask is not None:
        raise ValueError("attention(attn_mask=..., is_causal=True): give one of them, as to "
                         "F.scaled_dot_product_attention")
    if shard.ring is not None and is_causal and window is None and key.shape[-3] == query.shape[-3]:
        return shard.ring(query, key, value, scale=scale, dropout_p=dropout_p)
    if is_causal:
        attn_mask = causal_mask(query.shape[-2], query.device, window)
    local = key.shape[-2]
    key, value = gather_keys(key, -2, window), gather_keys(value, -2, window)
    gathered = key.shape[-2] if _window_tail(local, window) is None else key.shape[-2] - local  # the all-gathers' part
    per_token = (key.nbytes + value.nbytes) // key.shape[-2]
    shard.stats["kv_gather_bytes"] = max(shard.stats.get("kv_gather_bytes", 0), gathered * per_token)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=enable_gqa)
