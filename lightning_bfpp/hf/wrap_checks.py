"""What ``CausalLM`` checks of a Hugging Face model at construction: that its pipeline layers reproduce its own
logits, and that a model built on the meta device has real buffers."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..contract.router_loss import load_balancing_loss

PROBE_TOKENS = 16  # the construction check's sequence length (longer when a sliding window is shorter than 64)


def probe_ids(model: nn.Module) -> torch.Tensor:
    """2 x 16 deterministic token ids (longer than a sliding window under 64), on the model's device."""
    config = model.config
    window = getattr(config, "sliding_window", None) or 0
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or PROBE_TOKENS
    seq = min(limit, max(PROBE_TOKENS, window + 1 if window < 64 else 0))
    device = next(model.parameters()).device
    return (torch.arange(2 * seq, device=device).view(2, seq) * 7919 + 3) % config.vocab_size  # no RNG drawn


def check_layers_reproduce(model: nn.Module, pipeline_forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Run the model's own forward and `pipeline_forward` (its layers in order, side inputs as under bfpp) on a
    short deterministic sequence and raise a ValueError naming the model when the logits differ: its forward
    does something these layers do not. Costs two forward passes of 2 x 16 tokens (more for a short sliding
    window)."""
    ids = probe_ids(model)
    seq, name = ids.shape[1], type(model).__name__
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                expected = model(ids).logits
            except Exception as err:
                raise ValueError(f"CausalLM: {name}'s own forward fails on a 2 x {seq} token probe: {err}") from err
            try:
                got = pipeline_forward(ids)
            except Exception as err:
                raise ValueError(
                    f"CausalLM: {name}'s layers cannot run one after another as lightning_bfpp.hf calls them "
                    f"({type(err).__name__}: {err}). List its layers and side inputs yourself (docs/huggingface.md)."
                ) from err
    finally:
        model.train(training)
    gap = float("inf")
    if got.shape == expected.shape:
        gap = ((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-6)).item()
    if gap > max(1e-5, 2 * torch.finfo(expected.dtype).eps):  # the same ops in the same order: equal up to rounding
        raise ValueError(
            f"CausalLM: {name}'s pipeline layers do not reproduce its own forward (logits {tuple(got.shape)} vs "
            f"{tuple(expected.shape)}, largest difference {gap:.2g} of the largest logit, on 2 x {seq} tokens): its "
            "forward does something lightning_bfpp.hf does not know. List its layers and side inputs yourself "
            "(docs/huggingface.md), or pass check=False at your own risk."
        )


def check_meta_buffers(model: nn.Module) -> None:
    """transformers 4.x's ``_init_weights`` does not recompute buffers (GPT-2's causal masks): refuse a model whose
    buffers are on the meta device there, rather than train on uninitialized masks (rotary frequencies are
    recomputed by CausalLM; transformers 5 recomputes every buffer it makes)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).major >= 5:
        return
    unknown = [n for n, b in model.named_buffers() if b.is_meta and not n.endswith("inv_freq")]
    if unknown:
        raise ValueError(
            f"CausalLM: {type(model).__name__} was built on the meta device with transformers "
            f"{transformers.__version__}, which does not recompute its buffers ({unknown[0]}, ...): use "
            "CausalLM.from_pretrained(path) (buffers stay real), build the model in memory, or use transformers >= 5."
        )


def check_router_loss(model: nn.Module, pipeline_forward: Callable[[torch.Tensor], torch.Tensor], head: Any) -> None:
    """The router loss of `pipeline_forward`'s routing statistics (kept by `head`, ``hf.routing.RoutedHead``) equals
    the model's own ``aux_loss`` on the probe, else a ValueError naming the model."""
    ids, name, training = probe_ids(model), type(model).__name__, model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(ids, output_router_logits=True).aux_loss.float()
            pipeline_forward(ids)
            got = load_balancing_loss(head.last_stats).float()  # (float64 for a float64 model; transformers: float32)
    finally:
        model.train(training)
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
        raise ValueError(f"CausalLM: {name}'s router loss from its layers' routing statistics ({got.item():.6g}) is "
                         f"not its own aux_loss ({expected.item():.6g}) on a probe: its load_balancing_loss_func "
                         "differs from transformers' usual one. Set output_router_logits=False, or add the loss in "
                         "pipeline_loss.")
