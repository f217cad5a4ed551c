"""Search the layouts of a model on a cluster for one global batch size — (pp, dp, cp, tp), loops,
micro-batch count and size, schedule (incl. breadth-first groups), sharding and reshard policy, and for a mixture of
experts the expert-parallel size — by
simulating each one, drop those that do not fit in device memory, and rank the rest by tokens/s."""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..dims import ParallelDims, divisors
from ..schedule import (
    BREADTH_FIRST,
    LOOPED_SCHEDULES,
    SCHEDULES,
    ScheduleError,
    ScheduleSpec,
    build_schedule,
)
from .bounds import comm_lower_bound, memory_lower_bound, static_fits
from .cluster import Cluster
from .model import Model
from .residency import RESIDENCIES
from .search_cache import (
    candidate_costs,
    candidate_schedule,
    known_step,
    order_memory_lower_bound,
    simulated,
    throughput_bound,
)
from .simulate import SimOptions, SimResult, evaluate, simulate

DEFAULT_LOOPS = (1, 2, 3, 4, 6, 8, 16)


@dataclass(frozen=True)
class Candidate:
    """One layout: what `examples/train.py` needs to run it (plus the derived dp and micro-batch size)."""

    schedule: str
    pipeline_parallel: int
    data_parallel: int
    loops: int
    micro_batches: int
    micro_batch_size: int
    groups: int = 1
    sharding: str = "full"
    reshard_after_forward: bool = False
    tensor_parallel: int = 1
    # tensor_parallel > 1: activations between split modules and stages are sequence shards
    sequence_parallel: bool = False
    residency: str = "step"  # cost model only unless "step": FSDP weight residency (sim/residency.py)
    cache: int = 0  # stages kept gathered under residency="cache"
    expert_parallel: int = 1  # data-parallel ranks splitting each MoE layer's experts
    context_parallel: int = 1  # ranks sharing every sequence (each holds 1/cp of it)
    cross_step_overlap: bool = False  # the next step's first all-gathers start right after the optimizer step
    shard_unit: str = "stage"  # "layer": each layer its own FSDP unit (full sharding)

    @property
    def gradient_replicas(self) -> int:
        """Ranks sharing each parameter's state and gradient: dp x cp."""
        return self.data_parallel * self.context_parallel

    def options(self, options: SimOptions) -> SimOptions:
        """`options` as this candidate runs (its cross-step overlap)."""
        return replace(options, cross_step_overlap=self.cross_step_overlap)

    def spec(self) -> ScheduleSpec:
        return ScheduleSpec(self.schedule, pipeline_parallel=self.pipeline_parallel, loops=self.loops,
                            micro_batches=self.micro_batches, groups=self.groups,
                            reshard_after_forward=self.reshard_after_forward)

    def dims(self, devices_per_node: int | None = None) -> ParallelDims:
        """The layout as the runtime checks it. The cost-model-only sharding "optimizer" (the Megatron-like
        baselines' distributed optimizer, whose expert parallel partitions the experts) is checked as sharded: the
        runtime's rule against expert parallel with replicated weights is about bfpp's FSDP, not the baseline's."""
        return ParallelDims(world=self.pipeline_parallel * self.data_parallel * self.context_parallel
                            * self.tensor_parallel, spec=self.spec(), tensor_parallel=self.tensor_parallel,
                            context_parallel=self.context_parallel, devices_per_node=devices_per_node,
                            sequence_parallel=self.sequence_parallel, expert_parallel=self.expert_parallel,
                            sharding="full" if self.sharding == "optimizer" else self.sharding)

    def overrides(self, *, cluster: str | None = None, model: str | None = None,
                  batch_size: int | None = None) -> list[str]:
        """Hydra overrides for examples/train.py."""
        out = [
            f"schedule={self.schedule}",
            f"schedule.pipeline_parallel={self.pipeline_parallel}",
            f"schedule.loops={self.loops}",
            f"schedule.micro_batches={self.micro_batches}",
            f"schedule.groups={self.groups}",
            f"schedule.sharding={self.sharding}",
            f"schedule.reshard_after_forward={str(self.reshard_after_forward).lower()}",
            f"schedule.tensor_parallel={self.tensor_parallel}",
        ]
        out += ["schedule.sequence_parallel=true"] if self.sequence_parallel else []
        out += [f"schedule.expert_parallel={self.expert_parallel}"] if self.expert_parallel > 1 else []
        out += [f"schedule.context_parallel={self.context_parallel}"] if self.context_parallel > 1 else []
        out += ["schedule.cross_step_overlap=true"] if self.cross_step_overlap else []
        out += [f"schedule.shard_unit={self.shard_unit}"] if self.shard_unit != "stage" else []
        out += [f"model={model}"] if model else []
        out += [f"cluster={cluster}"] if cluster else []
        out += [f"data.batch_size={batch_size}"] if batch_size else []
        return out


@dataclass
class Plan:
    """A simulated candidate. `bubble` is the pure pipeline bubble (comm-free run; filled for the top)."""

    candidate: Candidate
    tokens_per_second_per_device: float
    step_time: float
    peak_memory: float
    fits: bool
    bubble: float | None = None
    exposed_comm: float | None = None

    def as_dict(self) -> dict:
        return {**asdict(self.candidate), **{k: v for k, v in asdict(self).items() if k != "candidate"}}


def candidates(
    model: Model,
    cluster: Cluster,
    batch_size: int,
    *,
    schedules: Sequence[str] = SCHEDULES,
    loops: Sequence[int] = DEFAULT_LOOPS,
    shardings: Sequence[str] = ("full", "none"),
    max_micro_batches: int | None = None,
    max_groups: int = 8,
    min_pipeline_parallel: int = 1,
    max_pipeline_parallel: int | None = None,
    tensor_parallels: Sequence[int] | None = None,
    sequence_parallels: Sequence[bool] = (False, True),
    residencies: Sequence[str] = RESIDENCIES,
    expert_parallels: Sequence[int] = (1,),
    context_parallels: Sequence[int] = (1,),
) -> Iterable[Candidate]:
    """Every legal layout using the whole cluster (world = pp * dp * cp * tp, tp dividing a node's devices and the
    model's heads; `tensor_parallels` None: all such tp; `context_parallels`: the cp sizes to try beside them, each
    splitting every sequence into 2 x cp chunks, so cp must leave the sequence divisible). pp=1 is plain FSDP/DDP with
    gradient accumulation over the micro-batches (1f1b: forward/backward alternate; gpipe: all forwards
    first); with loops > 1 the model is cut into `loops` FSDP units, and breadth_first runs each unit for
    all micro-batches of a group before the next (weights gathered once per group).

    Micro-batch counts ascend for each (tp, pp) up to the replica's batch (`max_micro_batches`: a cap, None:
    none); within one count, cheaper-in-memory variants (groups, reshard after forward, residency) follow
    the faster one they trade against. `expert_parallels`: expert-parallel sizes to try (those dividing dp and the
    model's experts)."""
    world = cluster.world_size
    tps = [t for t in (tensor_parallels or divisors(cluster.devices)) if model.n_head % t == 0 and model.vocab % t == 0]
    for tp, cp, pp in ((t, c, p) for t in tps for c in context_parallels if world % (t * c) == 0
                       for p in divisors(world // (t * c))):
        if not min_pipeline_parallel <= pp <= (max_pipeline_parallel or world):
            continue
        try:  # the layout's own rules (lightning_bfpp.dims): tp within a node, a layer per rank, the batch over dp
            dims = ParallelDims(world=world, devices_per_node=cluster.devices, tensor_parallel=tp, context_parallel=cp,
                                spec=ScheduleSpec(pipeline_parallel=pp)).validate(num_layers=model.num_layers,
                                                                                  global_batch=batch_size,
                                                                                  sequence=model.seq)
        except ScheduleError:
            continue
        dp, replica = dims.data_parallel, batch_size // dims.data_parallel
        for mbs in reversed(divisors(replica)):  # m ascending
            m = replica // mbs
            if max_micro_batches is not None and m > max_micro_batches:
                break
            for name, lp, groups in _orders(schedules, loops, m, max_groups):
                for sharding, sp in ((sh, sp) for sh in shardings for sp in sequence_parallels if tp > 1 or not sp):
                    for (raf, residency, cache), ep in ((v, e) for v in _fsdp_variants(sharding, lp, residencies)
                                                        for e in expert_parallels):
                        if ep > 1 and (not model.n_experts or model.n_experts % ep):
                            continue  # expert parallel needs experts it divides
                        c = Candidate(name, pipeline_parallel=pp, data_parallel=dp, loops=lp, micro_batches=m,
                                      micro_batch_size=mbs, groups=groups, sharding=sharding,
                                      reshard_after_forward=raf, tensor_parallel=tp, sequence_parallel=sp,
                                      residency=residency, cache=cache, expert_parallel=ep, context_parallel=cp)
                        try:
                            c.dims(cluster.devices).validate(num_layers=model.num_layers, global_batch=batch_size,
                                                             sequence=model.seq)
                        except ScheduleError:
                            continue
                        yield c


def _orders(schedules: Sequence[str], loops: Sequence[int], m: int, max_groups: int) -> Iterable[tuple[str, int, int]]:
    """(schedule, loops, groups) without twins: unlooped depth-first is 1f1b, ungrouped unlooped
    breadth-first is gpipe."""
    for name in schedules:
        for lp in loops if name in LOOPED_SCHEDULES else (1,):
            if name == "depth_first" and lp == 1 and "1f1b" in schedules:
                continue
            for groups in divisors(m) if name in BREADTH_FIRST else (1,):
                if groups <= max_groups and not (name == "breadth_first" and lp == 1 and groups == 1
                                                 and "gpipe" in schedules):
                    yield name, lp, groups


def _fsdp_variants(sharding: str, loops: int, residencies: Sequence[str]) -> list[tuple[bool, str, int]]:
    """(reshard_after_forward, residency, cache) to try, least memory-saving first. Only full sharding gathers;
    with one local stage per rank every residency keeps it for its one run of computes (= "step")."""
    if sharding != "full":
        return [(False, "step", 0)]
    out = [(raf, "step", 0) for raf in (False, True)] if "step" in residencies else []
    if loops > 2 and "cache" in residencies:
        out.append((False, "cache", 2))  # a small cache: the stage computing and the next
    if loops > 1 and "run" in residencies:
        out.append((False, "run", 0))
    return out


def simulate_candidate(model: Model, cluster: Cluster, c: Candidate,
                       options: SimOptions = SimOptions(),  # noqa: B008  (frozen dataclass: a safe shared default)
                       *, timeline: bool = False) -> SimResult:
    return simulate(candidate_schedule(c), candidate_costs(model, cluster, c), c.options(options), timeline=timeline)


def _family(c: Candidate) -> tuple:
    """A candidate up to its memory-for-speed knobs (groups, reshard after forward, residency)."""
    return (c.schedule, c.pipeline_parallel, c.loops, c.micro_batches, c.micro_batch_size, c.sharding,
            c.tensor_parallel, c.sequence_parallel, c.expert_parallel, c.context_parallel, c.cross_step_overlap,
            c.shard_unit)


def _fastest_variant(c: Candidate) -> bool:
    return c.groups == 1 and not c.reshard_after_forward and c.residency == "step"


def search(
    model: Model,
    cluster: Cluster,
    batch_size: int,
    *,
    options: SimOptions = SimOptions(),  # noqa: B008  (frozen dataclass: a safe shared default)
    top: int = 10,
    include_unfit: bool = False,
    cross_step_overlaps: Sequence[bool] = (False,),
    shard_units: Sequence[str] = ("stage",),
    exhaustive: bool = False,
    **space: Any,
) -> list[Plan]:
    """Simulate the candidates; return plans sorted best first (fitting ones only unless include_unfit).

    NOTE: more accumulation groups, resharding after forward and a shorter weight residency only trade speed
    for memory (more all-gathers and reduce-scatters, more bubble), so once a family's fastest variant (one
    group, no resharding, weights resident for the step) fits, its other variants are skipped; when it does
    not fit, every variant is simulated and the fastest fitting one wins. The top `top` plans are validated and
    re-simulated with the comm-free pass (bubble, exposed comm). A candidate is skipped unsimulated when its
    step-time lower bound cannot reach the `top`-th best fitting plan so far, so the first `top` plans are the true
    best `top` (the rest of the list is incomplete). `space`: the search-space keywords of
    `candidates` (schedules, loops, shardings, max_micro_batches, ...); `options` says how the runtime waits
    (e.g. `SimOptions(blocking_reduce=True)` on CPU). `cross_step_overlaps`: (False, True) also tries each candidate
    with cross-step overlap (``SimOptions.cross_step_overlap``; taken from the same simulation: it shortens the step by
    its ``cross_step_gain`` and holds no more memory than the step's peak), kept where it gains anything.
    `shard_units`: ("stage", "layer") also tries each fully sharded candidate with one FSDP unit per layer.
    `exhaustive`: skip nothing (every candidate simulated; what the pruned search's answer is tested against).
    """
    plans: list[Plan] = []
    settled: set[tuple] = set()  # families whose fastest variant fits
    keep = max(top, 1)
    leaders: list[float] = []  # min-heap: tokens/s/device of the best `keep` fitting plans so far
    bar = 0.0  # a candidate whose throughput bound is below it cannot enter the first `keep`
    prune = not include_unfit and not exhaustive
    # pruning: only candidates whose state fits, the highest throughput bound first (_in_search_order)
    for c in _in_search_order(model, cluster, _each_shard_unit(candidates(model, cluster, batch_size, **space),
                                                               shard_units), prune):
        family = _family(c)
        if not exhaustive and family in settled or prune and throughput_bound(model, cluster, c) < bar:
            continue
        devices = c.pipeline_parallel * c.tensor_parallel * c.context_parallel
        costs = candidate_costs(model, cluster, c)
        if prune and memory_lower_bound(c, costs) > cluster.usable_memory:
            continue
        key = (model, cluster, c, options)
        r = known_step(key)  # simulated by an earlier search (another method's, another table's)
        if r is None:
            if prune and order_memory_lower_bound(model, cluster, c) > cluster.usable_memory:
                continue  # its compute order alone holds more than fits (zero bubble's deferred weight passes)
            schedule = candidate_schedule(c)
            comm = comm_lower_bound(schedule, costs) if prune and bar else 0.0
            if comm and costs.tokens_per_step / comm / devices < bar:
                continue  # its gathers or reductions alone take longer than the best step so far
            r = simulated(key, schedule, costs, options)
        fits = r.peak_memory <= cluster.usable_memory
        if fits and prune and _fastest_variant(c):
            settled.add(family)
        if fits:
            heapq.heappush(leaders, r.tokens_per_second_per_device)
            if len(leaders) > keep:
                heapq.heappop(leaders)
            bar = leaders[0] if len(leaders) == keep else 0.0
        if fits or include_unfit:
            plans.append(Plan(c, r.tokens_per_second_per_device, r.step_time, r.peak_memory, fits))
            if True in cross_step_overlaps and r.cross_step_gain > 0 and not options.cross_step_overlap:
                step = r.step_time - r.cross_step_gain
                plans.append(Plan(replace(c, cross_step_overlap=True), r.tokens_per_step / step / devices, step,
                                  r.peak_memory, fits))
    plans.sort(key=lambda p: (not p.fits, -round(p.tokens_per_second_per_device, 6), p.peak_memory,
                              p.candidate.micro_batches, p.candidate.loops, p.candidate.pipeline_parallel))
    for p in plans[:top]:
        build_schedule(p.candidate.spec())  # validator: raises ScheduleError on a broken schedule
        r = evaluate(candidate_schedule(p.candidate), candidate_costs(model, cluster, p.candidate),
                     p.candidate.options(options), timeline=False)
        p.bubble, p.exposed_comm = r.pipeline_bubble, r.exposed_comm
    return plans


def _in_search_order(model: Model, cluster: Cluster, found: Iterable[Candidate], prune: bool) -> Iterable[Candidate]:
    """Pruning: the candidates whose state fits, the highest throughput bound first (branch and bound: the best plans
    are simulated early, so the bar that skips the rest rises fast). A family's variants share their bound and keep
    their order (the fastest variant first). Otherwise: as generated."""
    if not prune:
        return found
    return sorted((c for c in found if static_fits(model, cluster, c)),
                  key=lambda c: throughput_bound(model, cluster, c), reverse=True)


def _each_shard_unit(found: Iterable[Candidate], shard_units: Sequence[str]) -> Iterable[Candidate]:
    """Each candidate with each FSDP unit of `shard_units` (one per layer only where weights are sharded)."""
    for c in found:
        for unit in shard_units:
            if unit == "stage" or c.sharding == "full":
                yield replace(c, shard_unit=unit)


def format_table(plans: Sequence[Plan], limit: int = 15) -> str:
    head = (f"{'#':>3} {'schedule':<16} {'pp':>3} {'dp':>4} {'cp':>3} {'tp':>3} {'ep':>3} {'loops':>5} {'m':>4} "
            f"{'mbs':>4} {'grp':>3} {'shard':<5} {'raf':<5} {'resid':<6} {'tok/s/dev':>11} {'step ms':>9} "
            f"{'mem GB':>8} {'bubble':>7} {'exp.comm ms':>11}")
    rows = [head, "-" * len(head)]
    for i, p in enumerate(plans[:limit], 1):
        c = p.candidate
        bubble = "" if p.bubble is None else f"{p.bubble:.3f}"
        exposed = "" if p.exposed_comm is None else f"{p.exposed_comm * 1e3:.1f}"
        rows.append(
            f"{i:>3} {c.schedule:<16} {c.pipeline_parallel:>3} {c.data_parallel:>4} {c.context_parallel:>3} "
            f"{c.tensor_parallel:>3}"
            f"{'s' if c.sequence_parallel else ' '}{c.expert_parallel:>3}{c.loops:>5} {c.micro_batches:>4} "
            f"{c.micro_batch_size:>4} {c.groups:>3} {c.sharding:<5} {str(c.reshard_after_forward).lower():<5} "
            f"{c.residency + (str(c.cache) if c.cache else '') + ('/L' if c.shard_unit == 'layer' else ''):<6} "
            f"{p.tokens_per_second_per_device:>11.1f} {p.step_time * 1e3:>9.1f} {p.peak_memory / 1e9:>8.2f} "
            f"{bubble:>7} {exposed:>11}"
        )
    return "\n".join(rows)
