"""torch's ring attention (``torch.distributed.tensor.experimental``'s context parallel) for one attention call on
this rank's shard of every sequence, where it runs: CUDA, plain causal attention. Tested API surface: torch 2.13
(``_context_parallel._attention``: ``_cp_options``, ``_enable_context_parallel_dispatcher``); the import checks the
range (versions.SUPPORTED), tests/test_private_apis.py lists the names.

Why private: torch's public ``context_parallel(mesh, buffers=...)`` is a context manager that shards given buffers in
place and patches ``F.scaled_dot_product_attention`` for everything run inside it; bfpp shards the batch itself (the
pipeline's inputs, targets and side inputs) and calls attention through ``contract.context_parallel.attention``, so it
needs the step below that API: queries, keys and values as DTensors sharded on the sequence over the context-parallel
mesh, SDPA dispatched to torch's ring kernels by its DTensor dispatcher. Its load-balanced layout (rank i: chunks i and
2cp-1-i, ``_cp_options.enable_load_balance``) is bfpp's. Public alternative checked: ``context_parallel`` itself (in
place sharding of module buffers and a global patch of SDPA; no per-call use). On the CPU torch has no sharding rule
for its SDPA op (``_scaled_dot_product_flash_attention_for_cpu``): there bfpp all-gathers keys and values instead."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .versions import check_version

check_version("torch")

NAME = "torch ring attention (torch.distributed.tensor.experimental context parallel)"
GATHER = "keys and values all-gathered (torch.distributed.nn.functional.all_to_all_single), SDPA with position masks"


def ring_available(device: torch.device) -> bool:
    """Whether torch's ring attention runs here: a CUDA device and torch's context-parallel module."""
    if device.type != "cuda":
        return False
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention  # noqa: F401
    except ImportError:
        return False
    return True


def ring_attention(mesh) -> Callable[..., torch.Tensor]:
    """A function (query, key, value, scale=None, dropout_p=0.0) -> output, each (B, heads, T_local, head_dim): causal
    attention of this rank's queries over the whole sequences, by torch's ring attention over the 1-d context-parallel
    `mesh` (a DeviceMesh)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    cp._cp_options.enable_load_balance = True  # rank i holds chunks i and 2cp-1-i: bfpp's layout
    cp._enable_context_parallel_dispatcher()  # SDPA's aten ops on DTensors go to the ring kernels (forward, backward)
    placement = [Shard(2)]

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
               dropout_p: float = 0.0) -> torch.Tensor:
        q, k, v = (DTensor.from_local(t.contiguous(), mesh, placement, run_check=False) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p)
        return out.to_local()

    return attend
