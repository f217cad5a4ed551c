"""What the planner's searches share, across calls too (the paper reproduction runs hundreds over one model and
cluster): stage costs keyed by what they depend on, each cost set's throughput bound, compute orders (the last few) and
the memory bound each order sets, lowered schedules (up to a budget of actions) and simulated steps (their numbers
only). Every key holds all that decides its value; clearing only frees
memory."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from functools import lru_cache
from typing import Any, NamedTuple

from ..schedule import Schedule, ScheduleSpec, compute_order, lower
from .bounds import order_memory_bound, step_time_lower_bound
from .cluster import Cluster
from .cost import Costs, build_costs
from .model import Model
from .residency import relower
from .simulate import SimOptions, simulate

Candidate = Any  # a ``planner.Candidate`` (not imported: the planner imports this module)


class _Schedules:
    """The lowered schedules the searches share, least recently used dropped first once they hold more than `budget`
    actions in all (a schedule of many micro-batches is megabytes; a count of entries would not bound the bytes)."""

    def __init__(self, budget: int) -> None:
        self.budget, self.held, self.entries = budget, 0, OrderedDict()

    def __call__(self, spec: ScheduleSpec, residency: str, cache: int) -> Schedule:
        key = (spec, residency, cache)
        found = self.entries.get(key)
        if found is not None:
            self.entries.move_to_end(key)
            return found
        if residency == "step" and cache == 0:  # lowered without the validator (fast); picks are validated after
            schedule = Schedule(spec, lower(spec, _compute_order(_order_key(spec))))
        else:
            schedule = relower(self(spec, "step", 0), residency, cache)
        self.entries[key] = schedule
        self.held += _actions(schedule)
        while self.held > self.budget and len(self.entries) > 1:
            self.held -= _actions(self.entries.popitem(last=False)[1])
        return schedule

    def clear(self) -> None:
        self.held, self.entries = 0, OrderedDict()


def _actions(schedule: Schedule) -> int:
    return sum(len(actions) for actions in schedule.actions.values())


_SCHEDULES = _Schedules(budget=4_000_000)  # the paper reproduction at 2 and 4 sequences/GPU: 1.0 GB resident in all


def candidate_schedule(c: Candidate) -> Schedule:
    """The action lists the simulator plays for `c` (its residency's FSDP placement)."""
    return _SCHEDULES(c.spec(), c.residency, c.cache)


def _order_key(spec: ScheduleSpec) -> ScheduleSpec:
    """`spec` up to what its compute order does not depend on (FSDP's reshard policy is placed by lowering)."""
    return replace(spec, reshard_after_forward=False)


@lru_cache(maxsize=4)  # the orders of a family's variants (residencies, reshard policies): one at large m is ~20 MB
def _compute_order(spec: ScheduleSpec) -> dict:
    return compute_order(spec)


def order_memory_lower_bound(model: Model, cluster: Cluster, c: Candidate) -> float:
    """``bounds.order_memory_bound`` of `c`'s compute order (0 for a forward-only spec, whose forwards free their own
    activations): shared by the candidates with the same order and stage costs."""
    spec = c.spec()
    return 0.0 if spec.forward_only else _order_memory(model, cluster, _cost_key(c), _order_key(spec))


@lru_cache(maxsize=100_000)
def _order_memory(model: Model, cluster: Cluster, key: Candidate, spec: ScheduleSpec) -> float:
    return order_memory_bound(_compute_order(spec), _costs(model, cluster, key))


def candidate_costs(model: Model, cluster: Cluster, c: Candidate) -> Costs:
    """`c`'s stage costs: shared by every search (across calls too) with the candidates that differ only in what the
    costs do not depend on (schedule, groups, reshard policy, residency, cross-step overlap)."""
    return _costs(model, cluster, _cost_key(c))


def _cost_key(c: Candidate) -> Candidate:
    """`c` up to what its stage costs do not depend on."""
    return replace(c, schedule="", groups=1, reshard_after_forward=False, residency="step", cache=0,
                   cross_step_overlap=False)


@lru_cache(maxsize=4096)  # a 64-stage layout's costs are ~0.1 MB
def _costs(model: Model, cluster: Cluster, c: Candidate) -> Costs:
    return build_costs(model, cluster, pipeline_parallel=c.pipeline_parallel, loops=c.loops,
                       data_parallel=c.data_parallel, micro_batch_size=c.micro_batch_size,
                       micro_batches=c.micro_batches, sharding=c.sharding, tensor_parallel=c.tensor_parallel,
                       sequence_parallel=c.sequence_parallel, expert_parallel=c.expert_parallel,
                       context_parallel=c.context_parallel, shard_unit=c.shard_unit)


def throughput_bound(model: Model, cluster: Cluster, c: Candidate) -> float:
    """Tokens/s per device no run of `c` beats (its step-time lower bound): what the search orders and prunes by.
    It depends on `c`'s stage costs and on whether its schedule is zero-bubble, so it is shared by every candidate
    (and search) with the same costs."""
    return _throughput_bound(model, cluster, _cost_key(c), c.schedule == "breadth_first_zb")


@lru_cache(maxsize=100_000)
def _throughput_bound(model: Model, cluster: Cluster, key: Candidate, zero_bubble: bool) -> float:
    costs = _costs(model, cluster, key)
    step = step_time_lower_bound(replace(key, schedule="breadth_first_zb" if zero_bubble else ""), costs)
    return costs.tokens_per_step / step / (key.pipeline_parallel * key.tensor_parallel * key.context_parallel)


class Step(NamedTuple):
    """The numbers of a simulated step the search keeps (not the schedule or the timeline: they are megabytes)."""

    step_time: float
    tokens_per_second_per_device: float
    peak_memory: float
    cross_step_gain: float
    tokens_per_step: int


_STEPS: dict[tuple, Step] = {}  # (model, cluster, candidate, options) -> its simulated step, for every search
_MAX_STEPS = 200_000


def known_step(key: tuple) -> Step | None:
    """The step simulated for `key` (model, cluster, candidate, options) by an earlier search, if any."""
    return _STEPS.get(key)


def simulated(key: tuple, schedule: Schedule, costs: Costs, options: SimOptions) -> Step:
    r = simulate(schedule, costs, options, timeline=False)
    if len(_STEPS) >= _MAX_STEPS:
        _STEPS.clear()
    _STEPS[key] = step = Step(r.step_time, r.tokens_per_second_per_device, r.peak_memory, r.cross_step_gain,
                              r.tokens_per_step)
    return step


def clear_caches() -> None:
    """Forget what the searches share: stage costs, throughput bounds, compute orders and their memory bounds, lowered
    schedules, simulated steps (they are keyed by everything that decides them; this only frees memory)."""
    _costs.cache_clear()
    _throughput_bound.cache_clear()
    _compute_order.cache_clear()
    _order_memory.cache_clear()
    _SCHEDULES.clear()
    _STEPS.clear()
