"""Context parallel in a pipeline step: every rank of a context-parallel group loads its replica's whole batch, takes
its shard of every sequence (``contract.context_parallel``: chunks i and 2cp-1-i) of the inputs and targets, runs the
step with that shard active (attention gathers the rest), and, where a step's outputs are handed back (evaluation,
prediction, training metrics), gathers them whole again."""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._private.ring_attention import GATHER, NAME, ring_attention, ring_available
from ..contract.context_parallel import SEQUENCE_DIM, SequenceShard
from ..dims import CP


class ContextParallel:
    """This rank's share of every sequence of a context-parallel group (the `mesh`'s CP dimension)."""

    def __init__(self, mesh: DeviceMesh, device: torch.device) -> None:
        # torch 2.13 marks its autograd-aware collectives deprecated in favour of a private module
        # (torch.distributed._functional_collectives): the public one is what bfpp uses, without the warning per run
        warnings.filterwarnings("ignore", r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated",
                                FutureWarning)
        cp_mesh = mesh[CP]
        ring = ring_attention(cp_mesh) if ring_available(device) else None
        self.shard = SequenceShard(cp_mesh.size(), cp_mesh.get_local_rank(), cp_mesh.get_group(), ring)
        self.attention = NAME if ring is not None else GATHER  # plain causal attention's path (the log names it)

    def split(self, value: Any, what: str) -> Any:
        """This rank's shard of every tensor of `value` (a tensor or a flat tuple; None passes): dim 1 is the
        sequence; `what` names the value in the error a tensor without one gets."""
        if value is None:
            return None
        if isinstance(value, (tuple, list)):
            return type(value)(self.split(v, what) for v in value)
        if not isinstance(value, torch.Tensor):
            return value
        if value.dim() <= SEQUENCE_DIM:
            raise ValueError(
                f"context_parallel={self.shard.size} splits every sequence (dim {SEQUENCE_DIM}) of the batch over "
                f"{self.shard.size} ranks, and {what} holds a tensor of shape {tuple(value.shape)}, without one: give "
                "every input and target tensor the shape (batch, sequence, ...), or set context_parallel=1.")
        return self.shard.split(value, SEQUENCE_DIM)

    def whole(self, value: Any) -> Any:
        """Every rank's shard of a step's output (a tensor or a flat tuple) put together: whole sequences, in order."""
        if isinstance(value, (tuple, list)):
            return type(value)(self.whole(v) for v in value)
        if not isinstance(value, torch.Tensor) or value.dim() <= SEQUENCE_DIM:
            return value
        return self.shard.whole(value, SEQUENCE_DIM)
