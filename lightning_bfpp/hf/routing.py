"""A mixture-of-experts model's router loss through the pipeline: the load-balancing ``aux_loss`` that Mixtral,
Qwen3-MoE and the other families with ``load_balancing_loss_func`` add to their loss (times
``router_aux_loss_coef``) when ``output_router_logits=True``. It multiplies two means over every layer and token of
the batch (the fraction of top-k picks each expert gets, and its mean router probability), so it couples stages and
micro-batches: each decoder layer adds its routing statistics to a small tensor that travels beside the hidden states
(``RoutedLayer``), the head keeps it for the loss (``RoutedHead``), and ``contract.router_loss`` trains the model's
own definition over the whole step (exactly in one process, and in the pipeline through the step's totals)."""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ..contract.router_loss import router_stats, stats_dtype


def router_spec(model: nn.Module) -> tuple[type, int] | None:
    """(router module class, index of its logits in the router's output) as the model records ``router_logits``
    (transformers' ``_can_record_outputs``), or None for a model that records none."""
    for owner in (model, getattr(model, "model", None)):
        spec = (getattr(type(owner), "_can_record_outputs", None) or {}).get("router_logits")
        if spec is not None:
            return (spec.target_class, spec.index) if hasattr(spec, "target_class") else (spec, 0)
    return None


def router_coef(model: nn.Module) -> float | None:
    """``router_aux_loss_coef`` of a model whose config asks for the router loss (``output_router_logits=True``), else
    None; refuses a model whose router loss ``CausalLM`` cannot reproduce."""
    if not getattr(model.config, "output_router_logits", False):
        return None
    name = type(model).__name__
    if router_spec(model) is None or not hasattr(model, "router_aux_loss_coef") or \
            not hasattr(sys.modules[type(model).__module__], "load_balancing_loss_func"):
        raise ValueError(f"CausalLM: {name} has output_router_logits=True, and lightning_bfpp.hf trains the router "
                         "loss of models that record router_logits and use transformers' load_balancing_loss_func "
                         "(Mixtral, Qwen2/3-MoE, ...): set output_router_logits=False, or add the loss in your own "
                         "pipeline_loss.")
    return float(model.router_aux_loss_coef)


class RoutedLayer(nn.Module):
    """A decoder layer that adds its routers' statistics (`router_stats`) to the running `stats` it passes on with its
    output: (hidden, stats) -> (hidden, stats). A layer without a router passes them on. Not registered."""

    def __init__(self, layer: nn.Module, router_class: type, index: int, top_k: int, num_experts: int):
        super().__init__()
        self.layer, self.top_k, self.num_experts = layer, top_k, num_experts
        self._calls: list[torch.Tensor] = []
        for module in layer.modules():
            if isinstance(module, router_class):
                module.register_forward_hook(lambda _m, _a, out: self._calls.append(out[index]))

    def forward(self, hidden_states: torch.Tensor, stats: torch.Tensor | None = None, **kwargs: Any) -> Any:
        self._calls.clear()
        out = self.layer(hidden_states, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        if stats is None:
            stats = torch.zeros(2, self.num_experts + 1, device=hidden.device, dtype=stats_dtype(hidden))
        for logits in self._calls:
            stats = stats + router_stats(logits, self.top_k, self.num_experts)
        self._calls.clear()
        return hidden, stats


class RoutedHead(nn.Module):
    """The output layer of a routed model: it takes (hidden, stats), keeps `stats` for the micro-batch's loss
    (``last_stats``) and returns the logits alone, so the pipeline's output is what the model's is. Not registered."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head
        self.last_stats: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, stats: torch.Tensor | None = None, *rest: Any) -> torch.Tensor:
        self.last_stats = stats
        return self.head(hidden_states, *rest)


def routed_layers(layers: list[nn.Module], model: nn.Module) -> list[nn.Module]:
    """`layers` (an input layer, decoder layers, an output layer) with the decoder layers routed and the output layer
    keeping the statistics."""
    router_class, index = router_spec(model)
    config = model.config
    top_k = config.num_experts_per_tok
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    body = [RoutedLayer(layer, router_class, index, top_k, num_experts) for layer in layers[1:-1]]
    return [layers[0], *body, RoutedHead(layers[-1])]
