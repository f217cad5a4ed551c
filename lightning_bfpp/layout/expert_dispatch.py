"""One experts call under expert parallel: each token's top-k picks are sent to the ranks owning the picked experts
(all-to-all with uneven splits, torch's autograd-aware one: ``_private.torch_api.all_to_all_autograd``), those
ranks run the experts module's own forward on what they received (their 1/ep of the experts), and the outputs come
back the same way to be weighted and summed per token. Dropless: every pick is computed, so the result is the
module's own up to float rounding. Rank i of the expert-parallel group owns experts [i x E/ep, (i + 1) x E/ep)."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._private.torch_api import all_to_all_autograd


class ExpertParallelForward:
    """Installed as an experts module's ``forward`` (``layout.experts.distribute_experts``): dispatch, this rank's
    experts, combine. `group`: the expert-parallel process group; `part`: this rank's index in it.

    Statistics of the last call (for measurements): ``dispatched_bytes``, the hidden states of all this rank's
    picks (tokens x k rows, its own experts' included: the simulator's ``Layers.a2a_bytes`` per sample x samples),
    and ``sent_bytes``, what it sent to other ranks in its dispatch and combine all-to-alls."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, part: int):
        self.module, self.group = module, group
        self.ranks = dist.get_world_size(group)
        self.num_experts = module.num_experts
        self.local = self.num_experts // self.ranks
        self.first, self.part = part * self.local, part
        self.view = _LocalView(module, self.local)
        self.dispatched_bytes = self.sent_bytes = 0

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            raise TypeError("expert_parallel: an experts module is called as experts(hidden_states, top_k_index, "
                            f"top_k_weights); {type(self.module).__name__} got more arguments.")
        tokens, k = top_k_index.shape
        picks = top_k_index.reshape(-1)
        order = torch.argsort(picks, stable=True)  # picks grouped by expert, so by owning rank
        per_expert = torch.bincount(picks, minlength=self.num_experts)
        received_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(received_per_expert, per_expert, group=self.group)  # to each rank, its experts' counts
        send = per_expert.view(self.ranks, self.local).sum(1).tolist()
        receive = received_per_expert.view(self.ranks, self.local).sum(1).tolist()
        rows = hidden_states[order // k]
        received = all_to_all_autograd(rows, receive, send, self.group)
        experts = torch.arange(self.local, device=picks.device).repeat(self.ranks)  # per source rank, its experts
        local_ids = torch.repeat_interleave(experts, received_per_expert).unsqueeze(1)
        ones = torch.ones(local_ids.shape, dtype=top_k_weights.dtype, device=top_k_weights.device)
        out = self.view.run(received, local_ids, ones)
        back = all_to_all_autograd(out, send, receive, self.group)
        combined = torch.empty_like(back).index_copy(0, order, back)  # back in the picks' order: (token, k)
        row_bytes = rows.shape[1] * rows.element_size()
        self.dispatched_bytes = rows.shape[0] * row_bytes
        self.sent_bytes = (rows.shape[0] - send[self.part] + sum(receive) - receive[self.part]) * row_bytes
        weighted = combined.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(1).to(hidden_states.dtype)


class _LocalView:
    """The experts module's own forward over this rank's experts: a shallow copy of the module (its code, config
    and attributes, none of its hooks: its forward is called directly) whose ``num_experts`` is the local count and
    whose parameters are, at each call, the local tensors of the module's current (FSDP-gathered, expert-split)
    parameters, so gradients reach them."""

    def __init__(self, module: nn.Module, local: int):
        self.module = module
        self.copy = copy.copy(module)
        self.copy._parameters = {}  # its own (empty): the tensors of a call are plain attributes
        self.copy.num_experts = local

    def run(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tensors = {n: p.to_local() if hasattr(p, "to_local") else p
                   for n, p in self.module.named_parameters(recurse=False)}
        self.copy.__dict__.update(tensors)
        try:
            out = self.copy.forward(hidden, index, weights)
            if not torch.is_grad_enabled():
                return out
            # a zero term tying the output to every local weight and to the received rows, whatever was routed
            # here: every local weight gets a gradient (a rank none of whose experts got a token still joins its
            # FSDP group's reduction) and every rank runs the dispatch's backward all-to-all (the others wait for it)
            # Each weight is added to the rows' sum by itself: a node joining two weights before the rows would sit
            # in two of torch's zero-bubble weight groups (grouped where weights meet the input's path), run twice.
            anchor = hidden.sum()
            for p in tensors.values():
                if p.requires_grad:
                    anchor = anchor + p.reshape(-1)[0]
            return out + 0.0 * anchor
        finally:
            for name in tensors:
                del self.copy.__dict__[name]
