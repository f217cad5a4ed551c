"""What the cost model knows of a model — its pipeline layers as data (`Layers`) — and one source of
such data: the analytic shape of a decoder-only transformer (`Model`), dense or a mixture of experts."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from .cluster import Cluster

ACT_BYTES = 2  # bf16 activations and p2p messages


@dataclass(frozen=True)
class WireBytes:
    """Bytes per element of what a step moves: FSDP's gathered weights, its reduced gradients, the pipeline's
    stage-boundary messages. The default is the paper's regime (bf16 everywhere); ``for_precision`` gives what the
    runtime moves under a Lightning precision (``layout.fsdp.stage_mixed_precision``)."""

    weights: int = 2
    grads: int = 2
    messages: int = ACT_BYTES

    @classmethod
    def for_precision(cls, precision: str) -> WireBytes:
        """"bf16-mixed": bf16 gathers and messages, fp32 gradient reduction (FSDP2's reduce_dtype); "bf16-true": bf16
        throughout; "64-true": fp64; any other (e.g. "32-true"): fp32 throughout."""
        if precision == "bf16-mixed":
            return cls(2, 4, 2)
        if precision == "bf16-true":
            return cls(2, 2, 2)
        return cls(8, 8, 8) if str(precision).startswith("64") else cls(4, 4, 4)


@dataclass(frozen=True)
class Layers:
    """A model's pipeline layers, in order, as the cost model sees them (any model: measure or derive these).

    params: parameters per layer (`expert_params` of them a mixture's experts, split by expert parallel, whose
    tokens cross ranks in all-to-alls of `a2a_bytes` per sample: four per MoE layer and micro-batch, dispatch and
    combine in forward and their gradients in backward). forward_flops: forward FLOPs per token per layer.
    activation_bytes: bytes a layer saves for backward per sample of a micro-batch. seq: tokens per sample (per rank:
    under context parallel each rank's 1/cp of the sequence). width: elements per token sent between stages.
    recompute: activation checkpointing (backward repeats the forward). times: measured (forward, backward) seconds
    per layer per sample, or None (FLOPs / the cluster's achieved FLOP/s).
    tensor_parallel: the tp group these numbers are per rank of (params, FLOPs, activations already / tp).
    tp_comm: per layer, the tensor-parallel collectives of one sample (forward count, forward bytes, backward
    count, backward bytes), in all-reduces of the activation: an all-gather or a reduce-scatter counts half.
    workspace: per layer, transient bytes per sample while its backward runs (recomputed activations or
    activation gradients), on top of what `activation_bytes` keeps. wire: element sizes of the weights, gradients
    and messages the step moves (the run's precision). weight_grad_bytes: per layer, bytes per sample that a split
    backward's input-gradient pass keeps for its weight-gradient pass (the gradients of the outputs of the layer's
    parameter-owning modules: torch keeps them where the paths to the inputs and to the weights part), or None
    (unknown: zero bubble's memory is then a lower bound). context_parallel: the ranks sharing each sequence
    (`seq` is one rank's share; FLOPs per token still count attention over the whole sequence). cp_comm: per layer,
    the context-parallel collectives of one sample (forward count, forward bytes, backward count, backward bytes), bytes
    as the all-gathered (or reduce-scattered) tensor's full size: attention's keys and values.
    """

    params: tuple[int, ...]
    forward_flops: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    seq: int
    width: int
    recompute: bool = False
    times: tuple[tuple[float, float], ...] | None = None
    tensor_parallel: int = 1
    tp_comm: tuple[tuple[float, float, float, float], ...] | None = None
    workspace: tuple[float, ...] | None = None
    wire: WireBytes = WireBytes()
    weight_grad_bytes: tuple[float, ...] | None = None
    expert_params: tuple[int, ...] | None = None  # of `params`, a mixture of experts' experts (expert parallel splits)
    a2a_bytes: tuple[float, ...] | None = None  # per layer and sample: bytes of one all-to-all (dispatch or combine)
    context_parallel: int = 1
    cp_comm: tuple[tuple[int, float, int, float], ...] | None = None

    def __len__(self) -> int:
        return len(self.params)

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward + backward, no recompute), the whole tp group's."""
        return 3.0 * sum(self.forward_flops) * self.tensor_parallel


def training_flops_per_token(matmul_params: float, n_layer: int, n_embd: int, seq: int) -> float:
    """Model FLOPs per trained token (forward + backward, no recompute): 6 per matrix-multiply weight (2 forward,
    4 backward; an embedding lookup is free) plus attention's scores and values, 12 x layers x width x sequence
    (the non-causal count, as Megatron's formula). The one FLOPs formula: the simulator's `Model` and
    examples/train.py's MFU both use it."""
    return 6.0 * matmul_params + 12.0 * n_layer * n_embd * seq


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
    n_experts: int = 0  # > 0: every block's MLP is a mixture of this many experts, `top_k` per token
    top_k: int = 2
    expert_ffn: int | None = None  # an expert's hidden width (None: 4 x n_embd, as the example's MLP)
    gated_experts: bool = False  # SwiGLU experts (3 matrices: Mixtral, DeepSeek), else 2 (the example's GELU MLP)
    shared_experts: int = 0  # experts every token also goes through (DeepSeek's)

    @classmethod
    def from_dict(cls, cfg: Mapping) -> Model:
        moe = {k: cfg[k] for k in ("n_experts", "top_k", "expert_ffn", "gated_experts", "shared_experts") if k in cfg}
        return cls(int(cfg["n_layer"]), int(cfg["n_head"]), int(cfg["n_embd"]), int(cfg["block_size"]),
                   int(cfg["vocab_size"]), bool(cfg.get("activation_checkpointing", False)), **moe)

    # ---- a block's MLP: dense (4h, GELU) or a mixture of experts ----
    @property
    def _expert_matrices(self) -> int:
        """Parameters of one expert (or of the dense MLP): its matrices x width x hidden width."""
        f = self.expert_ffn or 4 * self.n_embd
        return (3 if self.gated_experts else 2) * self.n_embd * f

    def _mlp_params(self) -> tuple[int, int]:
        """(parameters of a block's MLP, the experts' part of them) on one rank of no tensor parallel."""
        if not self.n_experts:
            return 8 * self.n_embd * self.n_embd + 5 * self.n_embd, 0
        experts = self.n_experts * self._expert_matrices
        return experts + self.shared_experts * self._expert_matrices + self.n_embd * self.n_experts, experts

    def _mlp_active(self) -> float:
        """Matrix-multiply weights a token meets in a block's MLP (top_k and the shared experts, and the router)."""
        if not self.n_experts:
            return 8.0 * self.n_embd * self.n_embd
        return (self.top_k + self.shared_experts) * self._expert_matrices + self.n_embd * self.n_experts

    # Layers in pipeline order, as examples/gpt.py's pipeline_layers(): [embedding, *blocks, head].
    @property
    def num_layers(self) -> int:
        return self.n_layer + 2

    def _mlp_split(self, tensor_parallel: int) -> int:
        """What tensor parallel divides a block's MLP by: tp for a dense MLP; 1 for a mixture of experts, whose
        router and experts every tp rank computes whole (examples/gpt.py's plan, as the runtime's expert x tensor
        parallel: expert parallel splits the experts)."""
        return 1 if self.n_experts else tensor_parallel

    def layer_params(self, tensor_parallel: int = 1) -> list[int]:
        """Parameters per layer (per tp rank: split matrices and their column biases / tp; row biases, norms and
        position embeddings whole, as examples/gpt.py's tp plan; the untied embedding and head split by vocab; a
        mixture's router and experts whole, `_mlp_split`)."""
        h, t = self.n_embd, tensor_parallel
        # qkv + proj + MLP, 2 layer norms
        block = (4 * h * h + 2 * h) // t + self._mlp_params()[0] // self._mlp_split(t) + 6 * h
        return [self.vocab * h // t + self.seq * h] + [block] * self.n_layer + [self.vocab * h // t + 2 * h]

    def layer_expert_params(self, tensor_parallel: int = 1) -> list[int]:
        """Of `layer_params`, the experts' per layer (what expert parallel splits)."""
        block_experts = self._mlp_params()[1] // self._mlp_split(tensor_parallel)
        return [0] + [block_experts] * self.n_layer + [0]

    def layer_a2a_bytes(self, context_parallel: int = 1) -> list[float]:
        """Bytes of one of a MoE block's all-to-alls per sample: each of this rank's tokens' top_k copies of its
        activation (under context parallel a rank holds 1/cp of the tokens)."""
        tokens = self.seq // context_parallel
        return [0.0] + [float(ACT_BYTES * tokens * self.top_k * self.n_embd)] * self.n_layer + [0.0]

    def layer_forward_flops(self, tensor_parallel: int = 1) -> list[float]:
        """Forward FLOPs per token per layer (per tp rank): 2 x params for matmuls, plus 4*seq*h for attention
        scores and values (non-causal count, as Megatron's formula); the embedding lookup is free."""
        h, s, t = self.n_embd, self.seq, tensor_parallel
        block = (2 * 4 * h * h + 4 * s * h) / t + 2 * self._mlp_active() / self._mlp_split(t)
        return [0.0] + [float(block)] * self.n_layer + [2.0 * self.vocab * h / t]

    def _block_activation(self, b: int, t: int, sp: bool, cp: int = 1) -> float:
        """Korthikanti et al. 2022 (bf16, dropout): s*b*h*(34 + 5as/h) per block; with tp t, the split
        layers' part / t (10 + 24/t + 5as/(ht)); with sequence parallel too, everything / t. With context parallel
        cp each rank holds s/cp tokens, its scores are (s/cp) x s, and attention keeps the keys and values of the
        whole sequence (2 x 2sbh/t, of which the formula counts this rank's s/cp)."""
        h, s, a = self.n_embd, self.seq, self.n_head
        mlp = self._mlp_active() / (8.0 * h * h)  # a mixture's MLP part (19 of the 34) by the weights a token meets
        m = t / self._mlp_split(t)  # a mixture computed whole on every tp rank: its part is not / tp
        q = s / cp  # this rank's tokens
        gathered = 4 * (s - q) * b * h / t  # the other ranks' keys and values (bf16), saved for backward
        if sp:
            return q * b * h * ((15 + 19 * mlp * m) / t + 5 * a * s / (h * t)) + gathered
        return q * b * h * (10 + (5 + 19 * mlp * m) / t + 5 * a * s / (h * t)) + gathered

    def layer_activation_bytes(self, micro_batch_size: int, tensor_parallel: int = 1,
                               sequence_parallel: bool = False, context_parallel: int = 1) -> list[float]:
        """Saved activations per micro-batch and tp rank: the block formula, or its input only (2*s*b*h, / tp
        with sequence parallel) with activation checkpointing; the head keeps bf16 + fp32 logits, whole (the
        runtime gathers them over tp before the loss). Under context parallel, of this rank's 1/cp of the sequence
        (attention's gathered keys and values aside)."""
        h, b, t, cp = self.n_embd, micro_batch_size, tensor_parallel, context_parallel
        s = self.seq / cp
        edge = ACT_BYTES * s * b * h / (t if sequence_parallel else 1)
        block = edge if self.checkpointing else self._block_activation(b, t, sequence_parallel, cp)
        return [float(edge)] + [float(block)] * self.n_layer + [float(s * b * self.vocab * 6)]

    def layer_weight_grad_bytes(self, micro_batch_size: int, tensor_parallel: int = 1,
                                sequence_parallel: bool = False, context_parallel: int = 1) -> list[float]:
        """What a split backward keeps from each layer's input-gradient pass for its weight pass, per micro-batch
        and tp rank: the gradients of the outputs of its weight-owning modules (measured on examples/gpt.py, 11h per
        token per block). A block: q, k, v and fc (7h, column-split / tp), proj and fc2 (2h, whole: each rank's
        partial sum), two layer norms (2h, / tp with sequence parallel); the head: its norm and the logits (vocab /
        tp); the embedding: nothing (torch skips the first stage's input pass)."""
        h, s, b, t = self.n_embd, self.seq / context_parallel, micro_batch_size, tensor_parallel
        norm = h / (t if sequence_parallel else 1)
        unit = ACT_BYTES * s * b
        block = unit * (7 * h / t + 2 * h + 2 * norm)
        return [0.0] + [float(block)] * self.n_layer + [float(unit * (norm + self.vocab / t))]

    def layer_tp_comm(self, tensor_parallel: int, context_parallel: int = 1,
                      sequence_parallel: bool = False) -> list[tuple[float, float, float, float]]:
        """Tensor-parallel collectives per sample, counted as all-reduces of the activation (an all-gather or a
        reduce-scatter is half of one: half its volume, half its latency steps), as examples/gpt.py's plan issues
        them: a block all-reduces its activation twice in forward (after attention and MLP) and twice in backward
        (their inputs' gradients); with sequence parallel each becomes an all-gather + reduce-scatter, the same
        volume. The vocab-split embedding all-reduces its output; the head all-gathers its logits (forward) and
        all-reduces its input's gradient (backward). A mixture of experts, computed whole, has no collective of its
        own (attention's alone: one each way), but under sequence parallel its input sequence is all-gathered
        before it and its output's gradient in backward (half an all-reduce more each way).
        ``tests/test_tensor_parallel.py`` counts what the plan's blocks issue against this."""
        if tensor_parallel == 1:
            return [(0, 0.0, 0, 0.0)] * self.num_layers
        act = float(ACT_BYTES * self.seq / context_parallel * self.n_embd)
        logits = float(ACT_BYTES * self.seq / context_parallel * self.vocab)
        mixture = 1.5 if sequence_parallel else 1.0  # attention's, and the whole mixture's gather under sp
        block = (2, 2 * act, 2, 2 * act) if not self.n_experts else (mixture, mixture * act, mixture, mixture * act)
        return [(1, act, 0, 0.0)] + [block] * self.n_layer + [(1, logits / 2, 1, act)]

    def layer_cp_comm(self, tensor_parallel: int = 1, context_parallel: int = 1) -> list[tuple[int, float, int, float]]:
        """Context-parallel collectives per sample and tp rank: a block all-gathers its attention's keys and values
        over the cp group in forward (one collective of both: 2 x the whole sequence's s x h / tp, bf16) and
        reduce-scatters their gradients in backward (as large); the embedding and head mix no tokens. Bytes as the
        gathered tensor's full size (``cost.ring_time``'s)."""
        if context_parallel == 1:
            return [(0, 0.0, 0, 0.0)] * self.num_layers
        kv = float(2 * ACT_BYTES * self.seq * self.n_embd / tensor_parallel)
        return [(0, 0.0, 0, 0.0)] + [(1, kv, 1, kv)] * self.n_layer + [(0, 0.0, 0, 0.0)]

    def layer_times(self, cluster: Cluster, micro_batch_size: int, tensor_parallel: int = 1,
                    context_parallel: int = 1) -> list[tuple[float, float]] | None:
        """Measured (forward, backward) seconds per layer from `cluster.layer_times` when they were taken on
        a model of this shape, scaled linearly from the calibrated micro-batch size (and / tp, / cp); else None."""
        lt = cluster.layer_times
        if lt is None or lt.shape != (self.n_head, self.n_embd, self.seq, self.vocab):
            return None
        k = micro_batch_size / lt.micro_batch_size / tensor_parallel / context_parallel
        scale = lambda fb: (fb[0] * k, fb[1] * k)  # noqa: E731
        return [scale(lt.embedding)] + [scale(lt.block)] * self.n_layer + [scale(lt.head)]

    def layers(self, cluster: Cluster | None = None, tensor_parallel: int = 1,
               sequence_parallel: bool = False, context_parallel: int = 1) -> Layers:
        """These layers as the cost model's data, per tp rank and, under context parallel, per rank's 1/cp of the
        sequence (per-sample activations; `cluster`'s calibrated layer times when they were taken on this shape)."""
        t, sp, cp = tensor_parallel, sequence_parallel and tensor_parallel > 1, context_parallel
        if self.n_head % t or self.vocab % t:
            raise ValueError(f"tensor_parallel={t} must divide n_head={self.n_head} and vocab_size={self.vocab}.")
        if self.seq % (2 * cp if cp > 1 else 1):
            raise ValueError(f"context_parallel={cp}: the sequence ({self.seq}) must divide by 2 x cp = {2 * cp}.")
        times = self.layer_times(cluster, 1, t, cp) if cluster is not None else None
        full = replace(self, checkpointing=False)  # un-checkpointed activations
        return Layers(tuple(self.layer_params(t)), tuple(self.layer_forward_flops(t)),
                      tuple(self.layer_activation_bytes(1, t, sp, cp)), seq=self.seq // cp, width=self.n_embd,
                      recompute=self.checkpointing, times=tuple(times) if times else None, tensor_parallel=t,
                      tp_comm=tuple(self.layer_tp_comm(t, cp, sp)),
                      workspace=tuple(full.layer_activation_bytes(1, t, sp, cp)),
                      weight_grad_bytes=tuple(self.layer_weight_grad_bytes(1, t, sp, cp)), context_parallel=cp,
                      cp_comm=tuple(self.layer_cp_comm(t, cp)),
                      expert_params=tuple(self.layer_expert_params(t)) if self.n_experts else None,
                      a2a_bytes=tuple(self.layer_a2a_bytes(cp)) if self.n_experts else None)

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (``training_flops_per_token``): for MFU and tokens per second."""
        h = self.n_embd
        matmul = (4 * h * h + self._mlp_active()) * self.n_layer + self.vocab * h  # a mixture's: the weights met
        return training_flops_per_token(matmul, self.n_layer, h, self.seq)
