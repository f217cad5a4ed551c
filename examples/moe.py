"""The example GPT's mixture of experts (``model.n_experts > 0``; model=gpt_moe_tiny): in place of each block's MLP a
router sends every token to its `top_k` experts, whose outputs are weighted and summed, and the router's load-balancing
loss joins the training loss. The experts are one module of stacked weights, called as transformers' fused experts
are, so ``BFPPStrategy(expert_parallel=N)`` splits them over data-parallel ranks (``lightning_bfpp.layout.experts``).
The router's statistics and loss are ``lightning_bfpp.modeling``'s (``router_stats``, ``router_loss``)."""
from __future__ import annotations

from typing import Any, Protocol

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_bfpp.modeling import router_stats


class MoESettings(Protocol):
    """The settings a mixture of experts reads (``gpt.GPTConfig`` has them)."""

    n_embd: int  # width of the residual stream; each expert is an MLP C -> 4C -> C
    n_experts: int  # experts per block (0: a plain MLP, no mixture)
    top_k: int  # experts per token


def check_moe_settings(cfg: MoESettings) -> None:
    """Refuse a `top_k` the experts cannot serve (only when there is a mixture: `n_experts` > 0)."""
    if cfg.n_experts and not (isinstance(cfg.top_k, int) and 1 <= cfg.top_k <= cfg.n_experts):
        raise ValueError(f"model.top_k={cfg.top_k!r} must be between 1 and model.n_experts={cfg.n_experts} (the "
                         "experts each token goes to).")


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows (N, K) sorted by expert, weights (E, K, M), ends (E,): expert e's rows end at ends[e] -> (N, M). torch's
    grouped matmul where it runs (float32 or half types; its CPU kernel wants rows of a multiple of 16 bytes), else one
    matmul per expert."""
    kernel = rows.dtype in (torch.float32, torch.bfloat16, torch.float16)  # (no float64 kernel: precision="64-true")
    if hasattr(F, "grouped_mm") and kernel and all(d * rows.element_size() % 16 == 0 for d in weights.shape[1:]):
        return F.grouped_mm(rows, weights, offs=ends.to(torch.int32))
    starts = [0, *ends.tolist()[:-1]]
    return torch.cat([rows[a:b] @ w for a, b, w in zip(starts, ends.tolist(), weights)])


class Experts(nn.Module):
    """`n_experts` MLPs (C -> 4C -> C, GELU) as stacked weights, called as transformers' fused experts are:
    experts(x (N, C), top_k_index (N, k), top_k_weights (N, k)) -> (N, C), each token's picked experts weighted and
    summed. bfpp's expert parallel splits such a module over data-parallel ranks (lightning_bfpp.layout.experts)."""

    def __init__(self, cfg: MoESettings, out_std: float) -> None:
        super().__init__()
        self.num_experts, self.out_std = cfg.n_experts, out_std
        self.w_in = nn.Parameter(torch.empty(cfg.n_experts, cfg.n_embd, 4 * cfg.n_embd))
        self.w_out = nn.Parameter(torch.empty(cfg.n_experts, 4 * cfg.n_embd, cfg.n_embd))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.w_out, std=self.out_std)  # a residual projection

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        picks = top_k_index.reshape(-1)
        order = torch.argsort(picks, stable=True)  # (N * k,) picks grouped by expert
        ends = torch.bincount(picks, minlength=self.num_experts).cumsum(0)
        h = F.gelu(grouped_matmul(x[order // k], self.w_in, ends))
        y = grouped_matmul(h, self.w_out, ends)
        y = torch.empty_like(y).index_copy(0, order, y)  # back in (token, pick) order
        return (y.view(tokens, k, y.shape[-1]) * top_k_weights.unsqueeze(-1)).sum(1)


class MoE(nn.Module):
    """A mixture of experts in place of the MLP: each token goes to its `top_k` experts by router probability (those
    renormalized as weights). (B, T, C) -> ((B, T, C), the routing statistics of contract.router_loss)."""

    def __init__(self, cfg: MoESettings, out_std: float) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = Experts(cfg, out_std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.reshape(-1, x.shape[-1])  # (B * T, C)
        logits = self.router(h)
        probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # fp32 at least
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(h.dtype)
        out = self.experts(h, index, weights).view_as(x)
        return out, router_stats(logits, self.top_k, self.experts.num_experts)


def log_routing(module: L.LightningModule, stats: torch.Tensor, aux: torch.Tensor, **kwargs: Any) -> None:
    """Log the router loss trained (train_aux_loss) and how unevenly the batch's experts are picked (train_expert_load:
    the busiest expert's share of the picks x n_experts; 1 is perfectly even). `kwargs`: ``LightningModule.log``'s."""
    picks = stats[1, :-1]
    module.log("train_aux_loss", aux, **kwargs)
    module.log("train_expert_load", picks.max() / picks.sum() * picks.numel(), **kwargs)


def idle_expert_params(cfg: MoESettings, model: nn.Module) -> float:
    """The expert weights a token does not meet (all but `top_k` of every block's `n_experts`), for its FLOPs count;
    0 without a mixture."""
    if not getattr(cfg, "n_experts", 0):
        return 0
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    return experts * (1 - cfg.top_k / cfg.n_experts)
