# Scope: what the cost model knows of a model — its pipeline layers as data (`Layers`) — and one source of
# such data: the analytic shape of a decoder-only transformer (`Model`).
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cost import Cluster

ACT_BYTES = 2  # bf16 activations and p2p messages


@dataclass(frozen=True)
class Layers:
    """A model's pipeline layers, in order, as the cost model sees them (any model: measure or derive these).

    params: parameters per layer. forward_flops: forward FLOPs per token per layer. activation_bytes: bytes a
    layer saves for backward per sample of a micro-batch. seq: tokens per sample. width: elements per token sent
    between stages. recompute: activation checkpointing (backward repeats the forward). times: measured
    (forward, backward) seconds per layer per sample, or None (FLOPs / the cluster's achieved FLOP/s).
    """

    params: tuple[int, ...]
    forward_flops: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    seq: int
    width: int
    recompute: bool = False
    times: tuple[tuple[float, float], ...] | None = None

    def __len__(self) -> int:
        return len(self.params)

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward + backward, no recompute)."""
        return 3.0 * sum(self.forward_flops)


@dataclass(frozen=True)
class Model:
    """Shape of a decoder-only transformer from a `conf/model/*.yaml` dict, whose pipeline layers are
    [embedding, n_layer blocks, head] (examples/gpt.py, the paper's models); `layers()` describes them."""

    n_layer: int
    n_head: int
    n_embd: int
    seq: int
    vocab: int
    checkpointing: bool = False

    @classmethod
    def from_dict(cls, cfg: Mapping) -> Model:
        return cls(int(cfg["n_layer"]), int(cfg["n_head"]), int(cfg["n_embd"]), int(cfg["block_size"]),
                   int(cfg["vocab_size"]), bool(cfg.get("activation_checkpointing", False)))

    # Layers in pipeline order, as examples/gpt.py's pipeline_layers(): [embedding, *blocks, head].
    @property
    def num_layers(self) -> int:
        return self.n_layer + 2

    def layer_params(self) -> list[int]:
        h = self.n_embd
        block = 12 * h * h + 13 * h  # qkv + proj + 4h MLP (with biases) + 2 layer norms
        return [self.vocab * h + self.seq * h] + [block] * self.n_layer + [self.vocab * h + 2 * h]

    def layer_forward_flops(self) -> list[float]:
        """Forward FLOPs per token per layer: 2 x params for matmuls, plus 4*seq*h for attention scores
        and values (non-causal count, as Megatron's formula); the embedding lookup is free."""
        h, s = self.n_embd, self.seq
        block = 2 * (12 * h * h) + 4 * s * h
        return [0.0] + [float(block)] * self.n_layer + [2.0 * self.vocab * h]

    def layer_activation_bytes(self, micro_batch_size: int) -> list[float]:
        """Saved activations per micro-batch (Korthikanti et al. 2022, bf16, no tensor parallel):
        s*b*h*(34 + 5*a*s/h) per block, or its input only (2*s*b*h) with activation checkpointing;
        the head keeps bf16 + fp32 logits."""
        h, s, a, b = self.n_embd, self.seq, self.n_head, micro_batch_size
        block = 2 * s * b * h if self.checkpointing else s * b * h * (34 + 5 * a * s / h)
        return [float(ACT_BYTES * s * b * h)] + [float(block)] * self.n_layer + [float(s * b * self.vocab * 6)]

    def layer_times(self, cluster: Cluster, micro_batch_size: int) -> list[tuple[float, float]] | None:
        """Measured (forward, backward) seconds per layer from `cluster.layer_times` when they were taken on
        a model of this shape, scaled linearly from the calibrated micro-batch size; else None."""
        lt = cluster.layer_times
        if lt is None or lt.shape != (self.n_head, self.n_embd, self.seq, self.vocab):
            return None
        k = micro_batch_size / lt.micro_batch_size
        scale = lambda fb: (fb[0] * k, fb[1] * k)  # noqa: E731
        return [scale(lt.embedding)] + [scale(lt.block)] * self.n_layer + [scale(lt.head)]

    def layers(self, cluster: Cluster | None = None) -> Layers:
        """These layers as the cost model's data (per-sample activations; `cluster`'s calibrated layer times
        when they were taken on this shape)."""
        times = self.layer_times(cluster, 1) if cluster is not None else None
        return Layers(tuple(self.layer_params()), tuple(self.layer_forward_flops()), tuple(self.layer_activation_bytes(1)),
                      self.seq, self.n_embd, self.checkpointing, tuple(times) if times else None)

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward + backward, no recompute): for MFU/tokens-per-second."""
        return 3.0 * sum(self.layer_forward_flops())
