"""A mixture of experts' router loss, for any model whose layers carry routing statistics: the load-balancing loss of
the Switch Transformer as transformers' ``load_balancing_loss_func`` defines it (the fraction of top-k picks each expert
gets times its mean router probability, over every MoE layer and token of the batch). Layers add their
``router_stats`` to a small tensor passed along with the hidden states; ``router_loss`` is the part a micro-batch's
``(loss_sum, num_items)`` loss adds. In one process it is the loss of what the model is given. In a pipeline step it
follows the step's definition (``StepTotals.router_loss``, ``BFPPStrategy(router_loss=...)``):

- ``"batch"``: the whole step's loss, as the model's own ``aux_loss`` on the whole batch; through the step's totals
  (``step_totals``), whose gradient needs every micro-batch's routing before the first backward (gpipe, breadth-first
  in one group);
- ``"micro_batch"``: each micro-batch's own loss (its statistics summed over a context-parallel group's shards of its
  sequences), weighted by the micro-batch's counted items; under any schedule.

Used by ``lightning_bfpp.hf`` (``hf.routing``) and by the example's mixture of experts."""
from __future__ import annotations

import torch

from . import context_parallel
from .step_totals import StepTotals, active_step_totals

ROUTER_LOSSES = ("batch", "micro_batch")  # the definitions a pipeline step trains (BFPPStrategy(router_loss=...))


def stats_dtype(logits: torch.Tensor) -> torch.dtype:
    """The type routing statistics are kept in: float32 at least (float64 under precision="64-true")."""
    return torch.promote_types(logits.dtype, torch.float32)


def router_stats(logits: torch.Tensor, top_k: int, num_experts: int) -> torch.Tensor:
    """One router call's statistics as ``load_balancing_loss_func`` accumulates them: a (2, E + 1) tensor whose row 0
    holds each expert's summed router probability (with gradient) and row 1 each expert's top-k picks (no gradient),
    then the number of routed rows. In float32 at least (bf16 logits in float32, float64 ones as they are)."""
    dtype = stats_dtype(logits)
    probs = torch.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1, dtype=dtype)  # (rows, E)
    picks = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
    ones = torch.ones_like(picks, dtype=dtype)
    counts = torch.zeros(num_experts + 1, device=probs.device, dtype=dtype).index_add_(0, picks, ones)
    counts[num_experts] = probs.shape[0]
    prob_sums = torch.cat([probs.sum(0), probs.new_zeros(1)])
    return torch.stack([prob_sums, counts])


def load_balancing_loss(stats: torch.Tensor) -> torch.Tensor:
    """The model's ``aux_loss`` from statistics summed over every router call of the batch (`router_stats`):
    E x sum over experts of (picks / rows) x (probability sum / rows)."""
    num_experts, rows = stats.shape[1] - 1, stats[1, -1]
    return num_experts * torch.sum((stats[1, :-1].detach() / rows) * (stats[0, :-1] / rows))


class _RouterLossInPipeline(torch.autograd.Function):
    """The router loss of one micro-batch in a pipeline step: no value in the forward (it is the whole step's, logged
    after the step), and in the backward the gradient of ``coef x aux_loss x items`` with respect to this
    micro-batch's probability sums, from the step's totals: coef x items x E x picks / rows^2 (the picks carry no
    gradient, as in the model's own loss)."""

    @staticmethod
    def forward(ctx, stats: torch.Tensor, totals: StepTotals, coef: float) -> torch.Tensor:
        ctx.totals, ctx.coef = totals, coef
        return stats.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        stats, items = ctx.totals.total("router_stats"), ctx.totals.total("items")
        num_experts, rows = stats.shape[1] - 1, stats[1, -1]
        per_prob_sum = ctx.coef * items * num_experts * stats[1, :-1] / rows**2
        out = torch.zeros_like(stats)
        out[0, :-1] = grad * per_prob_sum
        return out, None, None


def router_loss(stats: torch.Tensor, items: torch.Tensor, coef: float) -> torch.Tensor:
    """The router loss's part of a ``(loss_sum, num_items)`` loss: ``coef x aux_loss x items`` (so that dividing by the
    batch's counted items gives the model's ``loss + coef x aux_loss``). In one process (no step totals active) from
    `stats` as given; in a pipeline step, by the step's definition: a micro-batch's part of the whole step's
    (``"batch"``, see `_RouterLossInPipeline`) or the micro-batch's own (``"micro_batch"``, `_micro_batch_loss`)."""
    totals = active_step_totals()
    if totals is None:
        return coef * load_balancing_loss(stats) * items
    totals.add("router_stats", stats)
    totals.add("items", items.reshape(1).to(stats.dtype))
    if totals.router_loss == "micro_batch":
        return _micro_batch_loss(stats, items, coef, totals)
    return _RouterLossInPipeline.apply(stats, totals, coef)


def _micro_batch_loss(stats: torch.Tensor, items: torch.Tensor, coef: float, totals: StepTotals) -> torch.Tensor:
    """``coef x aux_loss x items`` of this micro-batch alone. Under context parallel a micro-batch's sequences are
    shared by the group's ranks: its picks, rows and items are summed over the group (no gradient, as the picks carry
    none), and each rank's loss is linear in its own probability sums, so that the group's losses add up to the
    micro-batch's and each rank's gradient is the micro-batch's with respect to its part. Its value is 0, as the
    whole step's (the loss logged is the model's own); it adds the micro-batch's ``router_aux x items`` (this rank's
    part of it) to the step's totals, for `step_aux_loss`."""
    whole, count = stats.detach(), items.detach().reshape(1).to(stats.dtype)
    shard = context_parallel.current()
    if shard is not None and shard.size > 1:
        import torch.distributed as dist

        flat = torch.cat([whole.reshape(-1), count])
        dist.all_reduce(flat, group=shard.group)
        whole, count = flat[:-1].reshape(stats.shape), flat[-1:]
    num_experts, rows = stats.shape[1] - 1, whole[1, -1]
    aux_part = num_experts * torch.sum((whole[1, :-1] / rows) * (stats[0, :-1] / rows))  # sums to aux_loss over cp
    totals.add("router_aux", (aux_part * count).reshape(1))
    loss = coef * aux_part * count.squeeze(0)
    return loss - loss.detach()  # its gradient, and no value: logged after the step (`step_aux_loss`), as "batch"


def step_aux_loss(totals: StepTotals) -> torch.Tensor:
    """The router loss (``aux_loss``) a pipeline step trained, from its totals (read after the step): the whole step's
    (``"batch"``), or the micro-batches' own weighted by their counted items (``"micro_batch"``)."""
    if totals.router_loss == "micro_batch":
        return totals.total("router_aux")[0] / totals.total("items")[0]
    return load_balancing_loss(totals.total("router_stats"))
