"""Analytic costs of one training step's pieces — per-stage compute time, FSDP collective time,
pipeline p2p time, parameter and activation bytes — from a model's `Layers` and the Hydra `cluster` dict.
No schedule logic here: `simulate.py` plays a schedule's action lists against these numbers."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import NamedTuple

from ..dims import EDP, EP, ParallelDims
from ..schedule.actions import ScheduleSpec
from ..schedule.stage_cut import balanced_stage_layers
from .cluster import Cluster
from .model import ACT_BYTES, Layers, Model, WireBytes

# Bytes per parameter (mixed precision, Adam): fp32 master (4) + fp32 grad (4) + Adam m, v (8) held per
# rank (divided by dp under full sharding), plus bf16 compute weights (2) while a stage is gathered and a
# bf16 unsharded gradient (2) from a stage's first backward until its reduction.
STATE_BYTES = 16
WEIGHT_BYTES = WireBytes.weights  # the paper's regime (``WireBytes``: what a run of another precision moves)
GRAD_BYTES = WireBytes.grads
SHARDINGS = ("full", "none", "optimizer")


def state_bytes(params: float, sharding: str, data_parallel: int, whole: float | None = None) -> float:
    """Bytes held for the whole step per rank for `params` (per-rank) parameters, `whole` of them held whole on the
    rank (default all; with expert parallel the experts' 1/ep: each expert on dp / ep ranks, its state sharded there).

    full: FSDP, 16 B/param / dp. none: replicated, 16 + bf16 weights + bf16 grads. optimizer: Megatron-LM's
    distributed optimizer (its docs' table, bf16 params with fp32 main grads): 2 + 4 whole, + 12 / dp for the
    fp32 master weights and Adam moments."""
    whole = params if whole is None else whole
    if sharding == "full":
        return STATE_BYTES * params / data_parallel
    if sharding == "optimizer":
        return (2 + 4) * whole + 12 * params / data_parallel
    return (STATE_BYTES + WEIGHT_BYTES + GRAD_BYTES) * whole


def rank_state_bytes(stages: list[int], costs: Costs) -> float:
    """Bytes a pipeline rank holds for the whole step: the parameter/optimizer state of its `stages` (what the
    simulator counts as static, and the planner's compute-order memory bound starts from)."""
    return state_bytes(sum(costs.stages[s].params for s in stages), costs.sharding, costs.data_parallel,
                       sum(costs.stages[s].gathered_params for s in stages))


@lru_cache(maxsize=256)
def _stage_counts(params: tuple[int, ...], num_stages: int) -> tuple[int, ...]:
    return tuple(balanced_stage_layers(params, num_stages))  # the runtime's own split: one source of truth


@lru_cache(maxsize=256)
def _model_layers(model: Model, cluster: Cluster, tensor_parallel: int, sequence_parallel: bool,
                  context_parallel: int) -> Layers:
    """`model.layers(...)`, once per shape (the planner builds costs for thousands of candidates of a few shapes)."""
    return model.layers(cluster, tensor_parallel, sequence_parallel, context_parallel)


@dataclass(frozen=True)
class StageCost:
    """Costs of one pipeline stage for one micro-batch (seconds, parameter counts, bytes)."""

    forward: float
    backward: float
    params: int
    activation: float  # bytes kept from a micro-batch's forward until its backward
    unshard: float = 0.0  # all-gather of the stage's weights over dp
    reduce: float = 0.0  # reduce-scatter (full) or all-reduce (none) of its gradients over dp
    reduce_host: float = 0.0  # host seconds at REDUCE_GRAD (1/m gradient scaling), not communication
    workspace: float = 0.0  # transient bytes while one of its backwards runs
    weight_fraction: float = 0.5  # of `backward`, the weight-gradient part (a matmul's input and weight gradients
    # cost the same FLOPs): breadth_first_zb's W pass; its I pass is the rest. The first stage's is 1: its input needs
    # no gradient, so torch's I there does nothing and its W runs the whole backward
    weight_pass_bytes: float = 0.0  # what its input-gradient pass keeps until its weight pass (breadth_first_zb)
    inter_node: bool = False  # its dp collectives cross nodes (they share the rank's network interface)
    weight_bytes: int = WEIGHT_BYTES  # per parameter of its gathered weights
    grad_bytes: int = GRAD_BYTES  # per parameter of its unsharded gradient
    expert_params: int = 0  # of `params`, a mixture's experts: each rank gathers 1/expert_parallel of them
    expert_parallel: int = 1
    a2a_forward: float = 0.0  # seconds of its experts' all-to-alls for one micro-batch (dispatch + combine)
    a2a_backward: float = 0.0  # the same in backward (their gradients), in the input-gradient part
    # shard_unit="layer": each layer's share of `unshard` (its own all-gather, in order) and of the compute; a
    # stage's compute runs each layer once its weights arrived. Empty: the stage is one unit
    unit_gather: tuple[float, ...] = ()
    unit_share: tuple[float, ...] = ()

    @property
    def gathered_params(self) -> float:
        """Parameters a rank holds whole while the stage computes: all but the other ranks' experts."""
        return self.params - self.expert_params * (1 - 1 / self.expert_parallel)


@dataclass
class Costs:
    """Everything the simulator needs for one layout. `p2p[(src, dst)]` is the seconds of one
    activation (or gradient) message between pipeline ranks src and dst."""

    stages: list[StageCost]
    p2p: dict[tuple[int, int], float] = field(default_factory=dict)
    sharding: str = "full"  # full: FSDP (gathered weights transient) | none: replicated weights
    data_parallel: int = 1  # ranks sharing each parameter's state and gradient: dp, x cp under context parallel
    tokens_per_step: int = 0  # per data-parallel replica (whole sequences)
    device_memory: float = float("inf")
    flops_per_token: float = 0.0
    step_overhead: float = 0.0  # host seconds per step and rank outside the actions (runtime start and end)
    tensor_parallel: int = 1  # devices per pipeline rank of a replica: tp x cp
    p2p_inter: frozenset = frozenset()  # links (src, dst) between nodes (they share the sender's interface)

    def p2p_time(self, src: int, dst: int) -> float:
        return self.p2p.get((src, dst), 0.0)

    def without_comm(self) -> Costs:
        """The same compute with free communication (for pipeline bubble and exposed-comm numbers)."""
        stages = [replace(s, unshard=0.0, reduce=0.0, inter_node=False, a2a_forward=0.0, a2a_backward=0.0,
                          unit_gather=())
                  for s in self.stages]
        return replace(self, stages=stages, p2p={}, p2p_inter=frozenset())


def ring_time(nbytes: float, group: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather or reduce-scatter of a tensor of `nbytes` (full size) over `group` ranks."""
    if group <= 1:
        return 0.0
    return (group - 1) / group * nbytes / bandwidth + (group - 1) * latency


def build_costs(
    model: Model | Layers,
    cluster: Cluster,
    *,
    pipeline_parallel: int,
    loops: int,
    data_parallel: int,
    micro_batch_size: int,
    micro_batches: int,
    sharding: str = "full",
    stage_layers: Sequence[int] | None = None,
    activation_bytes: int | None = None,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    expert_parallel: int = 1,
    context_parallel: int = 1,
    shard_unit: str = "stage",
) -> Costs:
    """Per-stage costs of `model` (its `Layers`, or a transformer `Model` that describes them) cut into
    pipeline_parallel*loops stages on a (pp, dp, tp) mesh of `cluster`.

    `activation_bytes`: bytes per element of the p2p activations/gradients (None: the layers' `wire.messages`; 2:
    bf16, 4: a 32-true run). FSDP collectives move the layers' `wire.weights` / `wire.grads` bytes per parameter.
    NOTE: ranks are laid out as the runtime's mesh (``dims.ParallelDims``: tp innermost), so a tp group is
    one node's consecutive ranks, a dp group is tp ranks apart and pipeline neighbours dp*tp apart.
    Tensor-parallel collectives run on the in-node links on the compute's critical path (as the runtime's);
    activations cross stages whole, each tp rank sending to its counterpart, or (sequence parallel) as each
    rank's sequence shard (Korthikanti et al. 2022: the boundary tensor is sequence-split). With `expert_parallel`
    (ep consecutive data-parallel ranks) each rank gathers 1/ep of the experts over the dp / ep copies, and the
    tokens cross the ep group in all-to-alls (``a2a_time``) on the compute's critical path unless the simulator
    overlaps them (``SimOptions.expert_overlap``). Context parallel (cp, between dp and tp) gives each rank 1/cp of
    every sequence: its compute, activations and messages shrink, each attention layer all-gathers keys and values
    over the cp group in forward and reduce-scatters their gradients in backward (on the compute's critical path,
    in-node when cp x tp ranks fit a node), and gradients reduce over dp x cp. `shard_unit` "layer" (full sharding):
    each layer its own FSDP unit, one all-gather and one reduce-scatter per layer (each paying its latency), a stage's
    layers computing as their weights arrive (``StageCost.unit_gather``).
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} must be one of {SHARDINGS}.")
    pp, dp, tp, cp = pipeline_parallel, data_parallel, tensor_parallel, context_parallel
    if cluster.devices % tp:
        raise ValueError(f"tensor_parallel={tp} must divide the {cluster.devices} devices of a node.")
    num_stages = pp * loops
    dims = ParallelDims(world=pp * dp * cp * tp, spec=ScheduleSpec(pipeline_parallel=pp, loops=loops),
                        tensor_parallel=tp, context_parallel=cp, expert_parallel=expert_parallel)
    layers = model if isinstance(model, Layers) else _model_layers(model, cluster, tp, sequence_parallel, cp)
    if expert_parallel > 1 and (layers.expert_params is None or dp % expert_parallel):
        raise ValueError(f"expert_parallel={expert_parallel} needs a model with experts and data_parallel={dp} "
                         "divisible by it.")
    if layers.tensor_parallel != tp or layers.context_parallel != cp:
        raise ValueError(f"layers are per rank of tensor_parallel={layers.tensor_parallel}, context_parallel="
                         f"{layers.context_parallel}, not {tp}, {cp}.")
    if stage_layers is None:
        counts = _stage_counts(layers.params, num_stages)
    else:
        counts = tuple(stage_layers)
        if len(counts) != num_stages or sum(counts) != len(layers) or min(counts) < 1:
            raise ValueError(f"stage_layers={list(counts)} must list {num_stages} positive counts summing to "
                             f"the model's {len(layers)} layers.")
    message = message_bytes(layers, micro_batch_size, tp, sequence_parallel, activation_bytes)
    comm = _comm_times(layers, cluster, micro_batch_size, _cp_link(cluster, tp, cp))
    groups = {}  # pipeline rank -> its groups (the same for every stage it holds)
    stages, start = [], 0
    for s, n in enumerate(counts):
        span = range(start, start + n)
        if s % pp not in groups:
            first = dims.rank(s % pp, 0)
            groups[s % pp] = _Groups.of(cluster, dims.gradient_group(first), dims.group(EP, first),
                                        dims.group(EDP, first))
        stages.append(_stage_cost(layers, cluster, span, groups[s % pp], micro_batch_size=micro_batch_size,
                                  sharding=sharding, comm=comm,
                                  weight_pass_bytes=_weight_pass_bytes(layers, span, micro_batch_size, message),
                                  first_stage=s == 0, per_layer=shard_unit == "layer"))
        start += n
    tokens = micro_batch_size * layers.seq * cp  # whole sequences
    p2p, inter_links = _p2p_links(cluster, dims, message)
    return Costs(stages, p2p, sharding=sharding, data_parallel=dims.gradient_replicas,
                 tokens_per_step=tokens * micro_batches, device_memory=cluster.device_memory,
                 flops_per_token=layers.flops_per_token, step_overhead=cluster.step_overhead,
                 tensor_parallel=tp * cp, p2p_inter=inter_links)


def message_bytes(layers: Layers, micro_batch_size: int, tensor_parallel: int = 1, sequence_parallel: bool = False,
                  activation_bytes: int | None = None) -> float:
    """Bytes of one activation message between pipeline stages (its gradient is as large), per tp rank: the
    micro-batch's tokens x width (`layers.seq`: under context parallel each rank's 1/cp of the sequence), whole on every
    tp rank, or (sequence parallel) each rank's 1/tp of that.
    `activation_bytes` per element (None: the layers' ``wire.messages``). The runtime reports what it sends as
    ``step_stats["p2p_message_bytes"]``."""
    element = layers.wire.messages if activation_bytes is None else activation_bytes
    shards = tensor_parallel if sequence_parallel and tensor_parallel > 1 else 1
    return element * micro_batch_size * layers.seq * layers.width / shards


def kv_gather_bytes(layers: Layers, micro_batch_size: int, activation_bytes: int | None = None) -> float:
    """Bytes of one attention layer's keys and values that the context-parallel all-gather assembles on each rank for
    one micro-batch (the whole sequence's, of this tp rank's heads); the backward reduce-scatters as many. Per
    element `activation_bytes` (None: the layers' ``wire.messages``). The runtime reports what it gathers as
    ``step_stats["kv_gather_bytes"]``."""
    if not layers.cp_comm:
        return 0.0
    element = layers.wire.messages if activation_bytes is None else activation_bytes
    return max(b for _, b, _, _ in layers.cp_comm) / ACT_BYTES * element * micro_batch_size


def _weight_pass_bytes(layers: Layers, span: range, micro_batch_size: int, message: float) -> float:
    """What a stage keeps from a micro-batch's input-gradient pass until its weight pass (torch's split backward):
    its layers' ``weight_grad_bytes`` and, but on the last stage, the gradient it received for its output. The
    first stage runs no input pass (its input needs no gradient): it keeps only that gradient."""
    output_grad = message if span.stop < len(layers) else 0.0
    if span.start == 0 or layers.weight_grad_bytes is None:
        return output_grad
    return output_grad + sum(layers.weight_grad_bytes[i] for i in span) * micro_batch_size


def a2a_time(nbytes: float, group: int, bandwidth: float, latency: float) -> float:
    """An all-to-all over `group` ranks of `nbytes` per rank (all its rows, its own share included): each rank sends
    and receives (group - 1) / group of them, one message per peer."""
    if group <= 1:
        return 0.0
    return (group - 1) / group * nbytes / bandwidth + (group - 1) * latency


def _cp_link(cluster: Cluster, tensor_parallel: int, context_parallel: int) -> tuple[float, float]:
    """(bandwidth, latency) of a context-parallel group's collectives: its cp ranks are tp apart in cp x tp
    consecutive ranks, in-node when those fit a node."""
    if context_parallel * tensor_parallel <= cluster.devices:
        return (cluster.collective_bw or cluster.intra_bw,
                cluster.latency if cluster.intra_latency is None else cluster.intra_latency)
    return cluster.inter_bw, cluster.latency


class _Groups(NamedTuple):
    """A pipeline rank's collective groups as the cost model needs them: the gradient group's size, ring bandwidth
    and whether it crosses nodes; the expert-parallel group's size and bandwidth; the experts' copies' likewise."""

    dp: int
    bw: float
    inter_node: bool
    ep: int
    ep_bw: float
    copies: int
    copies_bw: float

    @classmethod
    def of(cls, cluster: Cluster, group: list[int], ep_group: list[int], copies: list[int]) -> _Groups:
        return cls(len(group), cluster.group_bandwidth(group), len({r // cluster.devices for r in group}) > 1,
                   len(ep_group), cluster.group_bandwidth(ep_group), len(copies), cluster.group_bandwidth(copies))


def _comm_times(layers: Layers, cluster: Cluster, micro_batch_size: int,
                cp_link: tuple[float, float]) -> tuple[list[float], list[float]]:
    """Per layer, seconds of its tensor- and context-parallel collectives for one micro-batch (forward, backward)."""
    tp_fwd, tp_bwd = _tp_times(layers, cluster, micro_batch_size)
    cp_fwd, cp_bwd = _cp_times(layers, micro_batch_size, *cp_link)
    return [a + b for a, b in zip(tp_fwd, cp_fwd)], [a + b for a, b in zip(tp_bwd, cp_bwd)]


def _stage_cost(layers: Layers, cluster: Cluster, span: range, groups: _Groups, micro_batch_size: int,
                sharding: str, comm: tuple[list[float], list[float]], weight_pass_bytes: float = 0.0, *,
                first_stage: bool = False, per_layer: bool = False) -> StageCost:
    """One stage (layers `span`) for one micro-batch: compute from calibrated layer times or FLOPs (recomputation
    repeats the forward), tp and cp collectives (`comm`, per layer: on the compute's critical path), dp collectives
    over its gradient group (dp, x cp under context parallel); with expert parallel (`groups.ep` > 1), the experts'
    share gathered over their copies and their all-to-alls. The first stage's backward is all weight pass (torch runs
    no input-gradient pass there)."""
    mbs, recompute = micro_batch_size, 1.0 if layers.recompute else 0.0
    p = sum(layers.params[i] for i in span)
    ep = groups.ep
    pe = sum(layers.expert_params[i] for i in span) if layers.expert_params else 0
    if layers.times:  # calibrated per-layer seconds
        fwd = sum(layers.times[i][0] for i in span) * mbs
        bwd = sum(layers.times[i][1] for i in span) * mbs + recompute * fwd
    else:
        fwd = sum(layers.forward_flops[i] for i in span) * mbs * layers.seq / cluster.flops
        bwd = (cluster.backward_factor + recompute) * fwd
    fwd_tp = sum(comm[0][i] for i in span)
    bwd_tp = sum(comm[1][i] for i in span) + recompute * fwd_tp
    lat = cluster.latency
    wire = layers.wire
    per_layer = per_layer and sharding == "full"
    units = [(i,) for i in span] if per_layer else [tuple(span)]  # the layers of each FSDP unit

    def ring(nbytes_per_param: float, unit: tuple[int, ...]) -> float:
        """One collective of the unit's weights: the dense ones over dp, each rank's 1/ep of the experts over their
        copies."""
        expert = sum(layers.expert_params[i] for i in unit) if ep > 1 else 0
        parts = [(sum(layers.params[i] for i in unit) - expert, groups.dp, groups.bw)]
        parts += [(expert / ep, groups.copies, groups.copies_bw)] if ep > 1 else []
        return sum(ring_time(nbytes_per_param * n, g, b, lat) for n, g, b in parts)

    unit_gather = tuple(ring(wire.weights, u) for u in units) if sharding == "full" else ()
    gather = sum(unit_gather)
    if sharding == "full":  # reduce-scatter (bf16 in the paper's regime)
        reduce = sum(ring(wire.grads, u) for u in units)
    elif sharding == "optimizer":  # fp32 reduce-scatter of the main grads, all-gather of updated params
        reduce = ring(4, units[0]) + ring(wire.weights, units[0])
    else:  # all-reduce
        reduce = 2 * ring(wire.grads, units[0])
    share = ()
    if per_layer:
        each = [layers.forward_flops[i] if not layers.times else layers.times[i][0] for i in span]
        share = tuple(x / (sum(each) or 1) for x in each)
    a2a = 0.0
    if ep > 1 and layers.a2a_bytes:  # two all-to-alls per MoE layer and pass (dispatch, combine)
        a2a = 2 * a2a_time(sum(layers.a2a_bytes[i] for i in span) * mbs, ep, groups.ep_bw, lat)
    work = max(layers.workspace[i] for i in span) * mbs if layers.workspace else 0.0
    return StageCost(fwd + fwd_tp + cluster.overhead, bwd + bwd_tp + cluster.overhead, p,
                     sum(layers.activation_bytes[i] for i in span) * mbs, gather, reduce,
                     reduce_host=cluster.grad_scale * p, workspace=work,
                     inter_node=groups.inter_node, weight_bytes=wire.weights,
                     grad_bytes=wire.grads, expert_params=pe if ep > 1 else 0, expert_parallel=ep, a2a_forward=a2a,
                     a2a_backward=a2a, weight_pass_bytes=weight_pass_bytes,
                     unit_gather=unit_gather if per_layer else (), unit_share=share,
                     **({"weight_fraction": 1.0} if first_stage else {}))


def _p2p_links(cluster: Cluster, dims: ParallelDims, message: float) -> tuple[dict, frozenset]:
    """Seconds of one message between neighbouring pipeline ranks, and the links that cross nodes: the slowest
    replica sets the pace (inter-node if any replica's pair crosses a node)."""
    p2p, inter_links = {}, set()
    latency = cluster.latency if cluster.p2p_latency is None else cluster.p2p_latency
    pp = dims.pipeline_parallel
    for src in range(pp):
        for dst in {(src + 1) % pp, (src - 1) % pp} - {src}:
            inter = any(dims.rank(src, d) // cluster.devices != dims.rank(dst, d) // cluster.devices
                        for d in range(dims.data_parallel))
            p2p[(src, dst)] = latency + message / (cluster.inter_bw if inter else cluster.intra_bw)
            if inter:
                inter_links.add((src, dst))
    return p2p, frozenset(inter_links)


def _tp_times(layers: Layers, cluster: Cluster, micro_batch_size: int) -> tuple[list[float], list[float]]:
    """Seconds of each layer's tensor-parallel collectives (forward, backward) for one micro-batch: ring
    all-reduce volume 2(t-1)/t x bytes on the in-node links, 2(t-1) latency steps per collective."""
    t = layers.tensor_parallel
    if t == 1 or not layers.tp_comm:
        return [0.0] * len(layers), [0.0] * len(layers)
    bw = cluster.collective_bw or cluster.intra_bw
    lat = cluster.latency if cluster.intra_latency is None else cluster.intra_latency
    one = lambda count, nbytes: count * 2 * (t - 1) * lat + 2 * (t - 1) / t * nbytes * micro_batch_size / bw  # noqa: E731
    return [one(c, b) for c, b, _, _ in layers.tp_comm], [one(c, b) for _, _, c, b in layers.tp_comm]


def _cp_times(layers: Layers, micro_batch_size: int, bandwidth: float,
              latency: float) -> tuple[list[float], list[float]]:
    """Seconds of each layer's context-parallel collectives (forward all-gather of keys and values, backward
    reduce-scatter of their gradients) for one micro-batch: ring volume (cp-1)/cp x the gathered bytes."""
    c = layers.context_parallel
    if c == 1 or not layers.cp_comm:
        return [0.0] * len(layers), [0.0] * len(layers)
    one = lambda count, nbytes: count * ring_time(nbytes * micro_batch_size, c, bandwidth, latency)  # noqa: E731
    return [one(n, b) for n, b, _, _ in layers.cp_comm], [one(n, b) for _, _, n, b in layers.cp_comm]


def unit_costs(num_stages: int, pipeline_parallel: int, *, forward: float = 1.0, backward: float = 2.0,
               unshard: float = 0.0, reduce: float = 0.0, p2p: float = 0.0, activation: float = 1.0,
               params: int = 1, sharding: str = "full") -> Costs:
    """Uniform stages (for pictures and closed-form tests): every stage costs the same (the first's backward, when
    split, all in its weight pass, as torch runs it)."""
    stages = [StageCost(forward, backward, params, activation, unshard, reduce, weight_fraction=1.0 if s == 0 else 0.5)
              for s in range(num_stages)]
    pp = pipeline_parallel
    links = {(a, b): p2p for a in range(pp) for b in ((a + 1) % pp, (a - 1) % pp) if a != b}
    return Costs(stages, links, sharding, data_parallel=2 if (unshard or reduce) else 1)
