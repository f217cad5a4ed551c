"""The one owner of the parallel layout: how the world's processes split into pipeline x data x context x tensor
parallel (the mesh's shape, dimension names and every rank's coordinates), how a mixture of experts' experts split over
ranks of the data-parallel group (expert parallel: its own mesh), how the model's layers fill the stages and a step's
batch the micro-batches, the sequence rule of sequence and context parallel, and its one `validate()`. The strategy,
the mesh builder (``layout.mesh``), the app's preflight and the planner all ask it; each names the settings in its
users' words (`Names`). As torchtitan's ``distributed/parallel_dims.py``; ``lightning_bfpp.schedule.dims`` is its old
path (a re-export).

May import: the schedule package and the standard library only (pure Python, no torch: ``lightning_bfpp.sim`` and
the app's preflight load it without torch)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from .schedule.actions import ScheduleError, ScheduleSpec
from .schedule.checks import is_count
from .schedule.generate import check_spec

# The mesh's dimensions, outermost first (tp innermost: a tensor-parallel group is contiguous ranks of one node; cp
# next to it, inside dp's place, as torchtitan orders them: a context-parallel group all-gathers keys and values in
# every attention layer, so it stays as close as tp allows). DP's name is a contract with Lightning:
# ModelParallelStrategy's `distributed_sampler_kwargs` reads ``device_mesh["data_parallel"]`` for the sampler's replica
# count and rank (all ranks of a replica, whatever their pipeline, context- or tensor-parallel coordinate, load the
# same batch; under context parallel bfpp then takes each rank's share of every sequence). Renaming it breaks the
# sampler.
PP, DP, TP = "pipeline_parallel", "data_parallel", "tensor_parallel"
# Expert parallel splits each data-parallel group into expert_data_parallel x expert_parallel (ep innermost: an
# expert-parallel group is consecutive data-parallel ranks, as torchtitan's and Megatron-Core's). The experts get their
# own mesh (PP, EDP, EP): the mesh above keeps DP whole for Lightning's sampler and the other weights' FSDP. Under
# context parallel an expert-parallel group is those ranks at one context-parallel coordinate (the tokens of a sequence
# shard are dispatched like any others), and EDP holds every rank with the same experts: copies x context ranks. Under
# tensor parallel the experts are not split by tp (Megatron's expert_tensor_parallel_size 1): the tp ranks of a replica
# compute the mixture on the same tokens (the whole sequence, gathered under sequence parallel, as every block a plan
# keeps whole), so each tp coordinate has its own expert mesh, (PP, EDP, EP) x TP, and its experts' gradients are its
# own (the same on every tp rank: not summed over tp).
EP, EDP = "expert_parallel", "expert_data_parallel"
CP = "context_parallel"
# The parameters' mesh under context parallel: dp x cp flattened into one dimension, over which FSDP shards the stages
# and gradients are reduced (every rank of it computes gradients of different tokens); tp stays as it is.
DP_CP = "data_context_parallel"

SHARDING = ("full", "none")  # full: FSDP2 over data parallel; none: replicated weights, gradients all-reduced


class LayoutError(ScheduleError):
    """The layout does not fit the world, the model or the batch (the message names the setting and a fix)."""


@dataclass(frozen=True)
class Names:
    """How a caller's users spell each setting in error messages (default: BFPPStrategy's arguments)."""

    schedule: str = "schedule"
    pipeline_parallel: str = "pipeline_parallel"
    tensor_parallel: str = "tensor_parallel"
    expert_parallel: str = "expert_parallel"
    context_parallel: str = "context_parallel"
    sequence_parallel: str = "sequence_parallel"
    loops: str = "loops"
    micro_batches: str = "micro_batches"
    groups: str = "groups"
    sharding: str = "sharding"
    world: str = "devices x num_nodes"
    devices: str = "devices"  # processes per node
    batch: str = "the global batch"
    replica_batch: str = "the per-replica batch"  # samples one data-parallel replica loads per step
    layers: str = "pipeline_layers()"
    sequence: str = "the sequence length (dim 1 of the first input)"  # shown as "<sequence>=<length>"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Coordinates(NamedTuple):
    """A rank's place in the mesh: its pipeline rank, data-parallel replica, tensor-parallel rank and
    context-parallel rank (its share of every sequence)."""

    pipeline: int
    data: int
    tensor: int
    context: int = 0


class ExpertCoordinates(NamedTuple):
    """Where a rank's data-parallel replica sits in the experts' mesh: which copy of the experts (`data`, over
    expert_data_parallel) and which part of them (`expert`, over expert_parallel)."""

    data: int
    expert: int


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """world = pipeline_parallel x data_parallel x context_parallel x tensor_parallel (tp innermost, within one
    node of `devices_per_node` processes; cp next); `spec` holds the schedule knobs (pp, loops, micro-batches, groups).
    Global rank = ((pipeline rank x dp + replica) x cp + context-parallel rank) x tp + tensor-parallel rank
    (``rank``, ``coordinates``)."""

    world: int
    spec: ScheduleSpec = field(default_factory=ScheduleSpec)
    tensor_parallel: int = 1
    devices_per_node: int | None = None  # None: one node holds the world
    sharding: str = "full"
    sequence_parallel: bool = False  # with tp > 1: activations between split modules are 1/tp of the sequence
    expert_parallel: int = 1  # ranks of a data-parallel group splitting each mixture-of-experts layer's experts
    context_parallel: int = 1  # ranks sharing every sequence: each holds 1/cp of it, attention gathers keys and values

    @property
    def pipeline_parallel(self) -> int:
        return self.spec.pipeline_parallel

    @property
    def data_parallel(self) -> int:
        return self.world // (self.spec.pipeline_parallel * self.context_parallel * self.tensor_parallel)

    @property
    def gradient_replicas(self) -> int:
        """Ranks over which each parameter's gradient is reduced (FSDP shards, or replicas all-reduce): dp x cp (the
        context-parallel ranks of a replica compute gradients of different tokens of the same batch)."""
        return self.data_parallel * self.context_parallel

    @property
    def num_stages(self) -> int:
        return self.spec.num_stages

    @property
    def sharded(self) -> bool:
        """Whether stages are FSDP-sharded (sharding="full" over more than one rank of dp x cp)."""
        return self.sharding == "full" and self.gradient_replicas > 1

    # ---- the mesh ---------------------------------------------------------------------------------------------
    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """(PP, DP), then CP when context_parallel > 1, and TP innermost when tensor_parallel > 1."""
        return (PP, DP) + ((CP,) if self.context_parallel > 1 else ()) + ((TP,) if self.tensor_parallel > 1 else ())

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes along `mesh_dim_names`."""
        sizes = {PP: self.pipeline_parallel, DP: self.data_parallel, CP: self.context_parallel,
                 TP: self.tensor_parallel}
        return tuple(sizes[name] for name in self.mesh_dim_names)

    @property
    def expert_data_parallel(self) -> int:
        """Copies of each expert (its FSDP group's size): data_parallel / expert_parallel."""
        return self.data_parallel // self.expert_parallel

    @property
    def expert_mesh_dim_names(self) -> tuple[str, ...]:
        """The experts' mesh: (PP, EDP, EP), and TP innermost when tensor_parallel > 1; EDP x EP is the data-parallel
        group (x the context-parallel one) at one tensor-parallel coordinate."""
        return (PP, EDP, EP) + ((TP,) if self.tensor_parallel > 1 else ())

    @property
    def expert_mesh_shape(self) -> tuple[int, ...]:
        """Sizes along `expert_mesh_dim_names`: EDP is the experts' copies x the context-parallel ranks."""
        tp = (self.tensor_parallel,) if self.tensor_parallel > 1 else ()
        return (self.pipeline_parallel, self.expert_data_parallel * self.context_parallel, self.expert_parallel) + tp

    def expert_mesh_ranks(self) -> list:
        """The global ranks of the experts' mesh, [pipeline][copy x cp + context][part] (`group(EDP | EP, rank)`), each
        a list over the tensor-parallel ranks [tensor] when tensor_parallel > 1."""
        cp, ep, tp = self.context_parallel, self.expert_parallel, self.tensor_parallel

        def at(p: int, data: int, context: int):
            ranks = [self.rank(p, data, t, context) for t in range(tp)]
            return ranks if tp > 1 else ranks[0]

        return [[[at(p, copy * ep + part, context) for part in range(ep)]
                 for copy in range(self.expert_data_parallel) for context in range(cp)]
                for p in range(self.pipeline_parallel)]

    def expert_coordinates(self, rank: int) -> ExpertCoordinates:
        """Which copy and which part of the experts global `rank` holds."""
        return ExpertCoordinates(*divmod(self.coordinates(rank).data, self.expert_parallel))

    @property
    def parameter_mesh_dim_names(self) -> tuple[str, ...]:
        """The dimensions of the mesh the parameters live on (FSDP's, tensor parallel's): the mesh itself, but under
        context parallel dp and cp are one dimension, DP_CP (FSDP shards and reduces over it)."""
        if self.context_parallel == 1:
            return self.mesh_dim_names
        return (PP, DP_CP) + ((TP,) if self.tensor_parallel > 1 else ())

    @property
    def parameter_mesh_shape(self) -> tuple[int, ...]:
        """Sizes along `parameter_mesh_dim_names` (the same ranks in the same order as `mesh_shape`)."""
        if self.context_parallel == 1:
            return self.mesh_shape
        return (self.pipeline_parallel, self.gradient_replicas) + ((self.tensor_parallel,)
                                                                   if self.tensor_parallel > 1 else ())

    def rank(self, pipeline: int, data: int, tensor: int = 0, context: int = 0) -> int:
        """The global rank at these mesh coordinates."""
        replica = pipeline * self.data_parallel + data
        return (replica * self.context_parallel + context) * self.tensor_parallel + tensor

    def coordinates(self, rank: int) -> Coordinates:
        """Where global `rank` sits in the mesh."""
        rest, tensor = divmod(rank, self.tensor_parallel)
        rest, context = divmod(rest, self.context_parallel)
        pipeline, data = divmod(rest, self.data_parallel)
        return Coordinates(pipeline, data, tensor, context)

    def group(self, dim: str, rank: int) -> list[int]:
        """The global ranks of `rank`'s group along mesh dimension `dim` (PP, DP, CP or TP), in order."""
        pipeline, data, tensor, context = self.coordinates(rank)
        if dim == PP:
            return [self.rank(p, data, tensor, context) for p in range(self.pipeline_parallel)]
        if dim == DP:
            return [self.rank(pipeline, d, tensor, context) for d in range(self.data_parallel)]
        if dim == CP:
            return [self.rank(pipeline, data, tensor, c) for c in range(self.context_parallel)]
        if dim == TP:
            return [self.rank(pipeline, data, t, context) for t in range(self.tensor_parallel)]
        copy, part = self.expert_coordinates(rank)
        if dim == EP:
            return [self.rank(pipeline, copy * self.expert_parallel + e, tensor, context)
                    for e in range(self.expert_parallel)]
        if dim == EDP:  # every rank holding the same experts: their copies x the context-parallel ranks (one tp rank)
            return [self.rank(pipeline, c * self.expert_parallel + part, tensor, ctx)
                    for c in range(self.expert_data_parallel) for ctx in range(self.context_parallel)]
        raise ValueError(f"{dim!r} is not a mesh dimension ({PP}, {DP}, {CP}, {TP}, {EP}, {EDP})")

    def gradient_group(self, rank: int) -> list[int]:
        """The global ranks that reduce `rank`'s gradients (`gradient_replicas`: its data-parallel replicas and
        context-parallel ranks, for its pipeline and tensor-parallel coordinates), in rank order."""
        pipeline, _, tensor, _ = self.coordinates(rank)
        return [self.rank(pipeline, d, tensor, c) for d in range(self.data_parallel)
                for c in range(self.context_parallel)]

    def gradient_groups(self) -> list[list[int]]:
        """Every `gradient_group`, each once, in the order of their lowest rank (collective group creation: every
        rank makes every group in this order)."""
        return [list(g) for g in sorted({tuple(self.gradient_group(r)) for r in range(self.world)})]

    def replica_leader(self, rank: int) -> int:
        """The lowest rank of `rank`'s data-parallel replica (the ranks that must load the same batch)."""
        return self.rank(0, self.coordinates(rank).data)

    def across_pipeline_ranks(self, pipeline_ranks: tuple[int, ...]) -> list[list[int]]:
        """For every (replica, context-parallel rank, tensor-parallel rank), in that order, the global ranks at
        `pipeline_ranks`: the groups over which the copies of a weight that several pipeline ranks hold are summed."""
        return [[self.rank(p, d, t, c) for p in pipeline_ranks]
                for d in range(self.data_parallel) for c in range(self.context_parallel)
                for t in range(self.tensor_parallel)]

    # ---- the sequence ------------------------------------------------------------------------------------------
    @property
    def sequence_divisor(self) -> int:
        """What every sequence length must divide by: under context parallel the 2 x cp chunks of each sequence (a
        rank holds two, load-balanced for causal attention), and under sequence parallel the tp ranks sharing each
        (context-parallel) shard: lcm(2 x cp, cp x tp)."""
        cp, sp = self.context_parallel, self.tensor_parallel if self.sequence_parallel else 1
        return math.lcm(2 * cp, cp * sp) if cp > 1 else sp

    def check_sequence(self, length: int | None, names: Names = Names()) -> None:
        """Raise LayoutError when a sequence of `length` (None: an input without a sequence dimension) cannot be
        split into `sequence_divisor` shards."""
        d, cp = self.sequence_divisor, self.context_parallel
        if d > 1 and cp > 1 and (length is None or length % d):
            sp = (f" and each rank's {length // cp if length else '?'} tokens over {names.tensor_parallel}="
                  f"{self.tensor_parallel} ({names.sequence_parallel})" if d != 2 * cp else "")
            raise LayoutError(
                f"{names.context_parallel}={cp} splits every sequence into 2 x {cp} = {2 * cp} chunks (each rank holds "
                f"chunks i and {2 * cp - 1}-i, balanced for causal attention){sp}, and {names.sequence}={length} does "
                f"not divide by {d}: make {names.sequence} a multiple of {d}, or choose another "
                f"{names.context_parallel}.")
        if d > 1 and (length is None or length % d):
            raise LayoutError(
                f"{names.sequence_parallel}=True splits every sequence over {names.tensor_parallel}={d} ranks, and "
                f"{names.sequence}={length} does not divide by {d}: make {names.sequence} a multiple of {d}, or set "
                f"{names.sequence_parallel}=False.")

    def validate(self, *, num_layers: int | None = None, global_batch: int | None = None,
                 sequence: int | None = None, names: Names = Names()) -> ParallelDims:
        """Raise ScheduleError / LayoutError naming the setting (in `names`' words) and a fix for the first rule
        broken; `num_layers`, `global_batch` and the `sequence` length are checked when known. Returns self."""
        check_spec(self.spec, names)
        self._check_options(names)
        self._check_world(names)
        self._check_expert_world(names)
        if num_layers is not None:
            self._check_layers(num_layers, names)
        if global_batch is not None:
            self.replica_batch(global_batch, names)
        if sequence is not None:
            self.check_sequence(sequence, names)
        return self

    def _check_options(self, n: Names) -> None:
        tp = self.tensor_parallel
        if not is_count(tp):
            raise LayoutError(f"{n.tensor_parallel}={tp!r} must be a positive integer (1: no tensor parallel; 2, 4, "
                              "8: processes of one node splitting every layer).")
        if not is_count(self.context_parallel):
            raise LayoutError(f"{n.context_parallel}={self.context_parallel!r} must be a positive integer (1: no "
                              "context parallel; 2, 4, ...: ranks sharing every sequence, each holding 1/cp of it).")
        if self.sequence_parallel not in (True, False):
            raise LayoutError(f"{n.sequence_parallel}={self.sequence_parallel!r} must be True, False or None (off).")
        if self.sequence_parallel and tp == 1:
            raise LayoutError(f"{n.sequence_parallel}=True splits the sequence over the tensor-parallel ranks, and "
                              f"{n.tensor_parallel}=1: set {n.tensor_parallel} > 1, or {n.sequence_parallel}=False.")
        if self.sharding not in SHARDING:
            raise LayoutError(f"{n.sharding}={self.sharding!r} is unknown; choose one of {', '.join(SHARDING)} (full: "
                              "FSDP over data parallel; none: replicated weights, gradients all-reduced).")
        self._check_expert_options(n)

    def _check_expert_options(self, n: Names) -> None:
        ep = self.expert_parallel
        if not is_count(ep):
            raise LayoutError(f"{n.expert_parallel}={ep!r} must be a positive integer (1: no expert parallel; 2, 4, "
                              "...: data-parallel ranks splitting each mixture-of-experts layer's experts).")
        if ep == 1:
            return
        if self.tensor_parallel > 1 and self.context_parallel > 1:
            raise LayoutError(f"{n.expert_parallel}={ep} with {n.tensor_parallel}={self.tensor_parallel} and "
                              f"{n.context_parallel}={self.context_parallel}: expert parallel combines with tensor "
                              "parallel or with context parallel, not with both at once yet; set "
                              f"{n.context_parallel}=1 (or {n.tensor_parallel}=1).")
        if self.sharding != "full":
            raise LayoutError(f"{n.expert_parallel}={ep} with {n.sharding}={self.sharding!r}: the experts' copies are "
                              f"FSDP-sharded over the data-parallel ranks that hold them; use {n.sharding}=full, or "
                              f"{n.expert_parallel}=1.")

    def _check_world(self, n: Names) -> None:
        world, pp, tp, cp = self.world, self.spec.pipeline_parallel, self.tensor_parallel, self.context_parallel
        if world % pp:
            raise LayoutError(
                f"{n.pipeline_parallel}={pp} must divide the world size {world} ({n.world}); use "
                f"{n.pipeline_parallel} in {divisors(world)}, or {n.world} a multiple of {pp}.")
        node = self.devices_per_node or world
        if cp > 1 and world % (pp * cp * tp):
            fits = [c for c in divisors(world // pp) if (world // pp) % (c * tp) == 0]
            raise LayoutError(
                f"{n.context_parallel} x {n.tensor_parallel} x {n.pipeline_parallel} = {cp} x {tp} x {pp} must divide "
                f"the world size {world} ({n.world}; data parallel = world / (pipeline x context x tensor parallel)); "
                f"use {n.context_parallel} in {fits}, or another {n.pipeline_parallel} or {n.world}.")
        if tp == 1:
            return
        if node % tp:
            raise LayoutError(
                f"{n.tensor_parallel}={tp} must divide the processes per node {n.devices}={node}: a tensor-parallel "
                f"group all-reduces inside every layer, so it stays within one node; use {n.tensor_parallel} in "
                f"{divisors(node)}.")
        if world % (pp * cp * tp):
            fits = [t for t in divisors(node) if world % (pp * cp * t) == 0]
            raise LayoutError(
                f"{n.pipeline_parallel} x {n.tensor_parallel} = {pp} x {tp} must divide the world size {world} "
                f"({n.world}; data parallel = world / (pipeline x tensor parallel)); use {n.tensor_parallel} in "
                f"{fits}, or another {n.pipeline_parallel}.")

    def _check_expert_world(self, n: Names) -> None:
        ep, dp, pp = self.expert_parallel, self.data_parallel, self.spec.pipeline_parallel
        if ep > 1 and dp % ep:
            others = "".join(f" / {name}={size}" for name, size in ((n.context_parallel, self.context_parallel),
                                                                    (n.tensor_parallel, self.tensor_parallel))
                             if size > 1)
            raise LayoutError(
                f"{n.expert_parallel}={ep} must divide the data-parallel size {dp} ({n.world}={self.world} / "
                f"{n.pipeline_parallel}={pp}{others}): the experts are split over {ep} data-parallel ranks; use "
                f"{n.expert_parallel} in {divisors(dp)}, or a {n.pipeline_parallel} leaving a multiple of {ep} "
                "data-parallel ranks.")

    def _check_layers(self, num_layers: int, n: Names) -> None:
        pp, loops = self.spec.pipeline_parallel, self.spec.loops
        if self.num_stages > num_layers:
            fix = f"{n.loops}={num_layers // pp}" if num_layers >= pp else f"{n.pipeline_parallel}<={num_layers}"
            raise LayoutError(
                f"{pp} x {loops} = {self.num_stages} stages ({n.pipeline_parallel} x {n.loops}) need at least as many "
                f"layers, but {n.layers} gives {num_layers}; use {fix}.")

    def replica_batch(self, global_batch: int, names: Names = Names()) -> int:
        """Samples each data-parallel replica loads per step (checked to split into the micro-batches)."""
        dp, m = self.data_parallel, self.spec.micro_batches
        unit = dp * m
        if global_batch % unit:
            sizes = " or ".join(map(str, nearest_multiples(global_batch, unit)))
            split = f", in {m} micro-batches); use {names.batch}={sizes}, or change {names.micro_batches}." if m > 1 \
                else f"); use {names.batch}={sizes}."
            raise LayoutError(
                f"{names.batch}={global_batch} (global, per optimizer step) must be divisible by data_parallel x "
                f"{names.micro_batches} = {dp} x {m} = {unit} (each data-parallel replica loads {names.batch} / {dp}"
                f"{split}")
        return global_batch // dp

    def micro_batch_size(self, replica_batch: int, names: Names = Names()) -> int:
        return micro_batch_size(replica_batch, self.spec.micro_batches, names)


def nearest_multiples(size: int, unit: int) -> list[int]:
    """The multiples of `unit` next to `size` (below it when there is one, and above it): the valid sizes to offer."""
    return sorted({max(unit, size // unit * unit), (size // unit + 1) * unit})


def micro_batch_size(replica_batch: int, micro_batches: int, names: Names = Names()) -> int:
    """Samples per micro-batch of a replica's batch of `replica_batch` samples (checked to split evenly)."""
    if replica_batch % micro_batches:
        sizes = " or ".join(map(str, nearest_multiples(replica_batch, micro_batches)))
        counts = [m for m in divisors(replica_batch) if m > 1]
        raise LayoutError(
            f"{names.replica_batch}={replica_batch} (per data-parallel replica) is not a multiple of "
            f"{names.micro_batches}={micro_batches}; use {names.replica_batch}={sizes}"
            + (f", or {names.micro_batches} in {counts}" if counts else "") + " (a loader's ragged last batch: "
            "drop_last=True).")
    return replica_batch // micro_batches


def default_pipeline_parallel(world: int, tensor_parallel: int = 1, loops: int = 1,
                              num_layers: int | None = None, expert_parallel: int = 1,
                              context_parallel: int = 1) -> int:
    """Every process a pipeline rank (but the expert_parallel replicas that split the experts): the largest divisor
    of world / (tensor_parallel x context_parallel x expert_parallel) that leaves every one of the pp x loops stages a
    layer (`num_layers`, once the model is known)."""
    ranks = max(world // (tensor_parallel * context_parallel * expert_parallel), 1)
    return max(pp for pp in divisors(ranks) if num_layers is None or pp * loops <= num_layers or pp == 1)
