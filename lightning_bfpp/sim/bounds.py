"""What no run of a candidate layout can beat, checked before it is lowered and simulated (the planner's pruning):
its memory (from its layout alone, then from its compute order), its step time and its data-parallel collectives'
time, and a cheap pre-filter on its weights' state."""
from __future__ import annotations

from typing import Any

from ..schedule import BREADTH_FIRST, Action, Op, Schedule
from .cluster import Cluster
from .cost import Costs, rank_state_bytes, state_bytes
from .model import Model

Candidate = Any  # a ``planner.Candidate`` (not imported: the planner imports this module)


def memory_lower_bound(c: Candidate, costs: Costs) -> float:
    """Bytes some rank certainly needs (checked before lowering and simulating): its state, and the
    activations a schedule must hold at once — breadth-first/GPipe run every forward of a group on all
    local stages before the first backward; 1F1B's first rank holds min(pp, m) micro-batches — plus one
    backward's working set and the gathered weights (all local stages' in such a group pass). With accumulation
    groups (g >= 2, sharded, weights resident for the step) the last group's backward also finds every local stage's
    unsharded gradient, held since the first group's backward (such a stage's gradients are reduced once per step,
    after its last group; shorter residencies reduce per run)."""
    pp, worst = c.pipeline_parallel, 0.0
    for rank in range(pp):
        local = [costs.stages[s] for s in range(rank, len(costs.stages), pp)]
        params = sum(st.params for st in local)
        state = state_bytes(params, c.sharding, c.gradient_replicas, sum(st.gathered_params for st in local))
        act = sum(st.activation for st in local)
        if c.schedule in ("gpipe", "breadth_first"):
            live = c.micro_batches // c.groups * act
        elif c.schedule == "breadth_first_zb":  # its last local stage's weight passes may free some early
            live = c.micro_batches // c.groups * (act - local[-1].activation) + local[-1].activation
        elif c.schedule == "1f1b" and rank == 0:
            live = min(pp, c.micro_batches) * act
        else:
            live = max(st.activation for st in local)
        weights = [st.weight_bytes * st.gathered_params for st in local] if c.sharding == "full" else [0.0]
        # a group pass keeps every local stage gathered from its first forward to its last backward: at the last
        # local stage's first backward all are (unless resharded after forward or under a shorter residency)
        whole_pass = c.schedule in BREADTH_FIRST + ("gpipe",) and not c.reshard_after_forward and c.residency == "step"
        gathered = sum(weights) if whole_pass else max(weights)
        held = c.groups > 1 and c.sharding == "full" and c.schedule in BREADTH_FIRST and c.residency == "step"
        grads = sum(st.grad_bytes * st.gathered_params for st in local) if held else 0.0
        worst = max(worst, state + live + gathered + grads + min(st.workspace for st in local))
    return worst


def order_memory_bound(order: dict[int, list[Action]], costs: Costs) -> float:
    """Bytes some rank certainly needs when it computes in `order` (its schedule's compute order, before lowering):
    its state, and at the fullest point of its order the activations held from each forward to its backward (to its
    weight pass W under zero bubble) plus what each input-gradient pass I keeps for its W — the simulator's own
    accounting of those two, which a rank's order alone decides. Gathered weights, gradients and a backward's working
    set are left out (they depend on timing), so no simulated peak is below it; zero bubble's deferred W passes hold
    activations that the layout-only `memory_lower_bound` cannot see."""
    worst = 0.0
    for rank, actions in order.items():
        level = most = 0.0
        for a in actions:
            st = costs.stages[a.stage]
            if a.op is Op.FORWARD:
                level += st.activation
                most = max(most, level)
            elif a.op is Op.BACKWARD_INPUT:
                level += st.weight_pass_bytes
                most = max(most, level)
            elif a.op is Op.BACKWARD:
                level -= st.activation
            elif a.op is Op.BACKWARD_WEIGHT:
                level -= st.activation + st.weight_pass_bytes
        worst = max(worst, rank_state_bytes(list(range(rank, len(costs.stages), len(order))), costs) + most)
    return worst


def step_time_lower_bound(c: Candidate, costs: Costs) -> float:
    """Seconds no schedule can beat: pipeline rank r cannot start before stages 0..r-1 ran one forward, is
    busy for its m forwards and backwards, and its last backward is followed by stages r-1..0's backward (not under
    breadth_first_zb: its own deferred weight-gradient passes may run while those do)."""
    st, pp, bound = costs.stages, c.pipeline_parallel, 0.0
    tail = 0.0 if c.schedule == "breadth_first_zb" else 1.0
    for r in range(pp):
        busy = c.micro_batches * sum(x.forward + x.backward for x in st[r::pp])
        edges = sum(x.forward + tail * x.backward for x in st[:r])
        bound = max(bound, edges + busy)
    return bound + costs.step_overhead


def _fsdp_counts(schedule: Schedule) -> list[dict[int, list[int]]]:
    """Per rank, stage -> [all-gathers, gradient reductions] in its action list (cached on the schedule)."""
    cached = schedule.__dict__.get("_fsdp_counts")
    if cached is None:
        cached = []
        for rank in range(schedule.spec.pipeline_parallel):
            counts: dict[int, list[int]] = {}
            for a in schedule.actions[rank]:
                if a.op is Op.UNSHARD or a.op is Op.REDUCE_GRAD:
                    counts.setdefault(a.stage, [0, 0])[a.op is Op.REDUCE_GRAD] += 1
            cached.append(counts)
        schedule.__dict__["_fsdp_counts"] = cached
    return cached


def comm_lower_bound(schedule: Schedule, costs: Costs) -> float:
    """Seconds no run of `schedule` can beat for its data-parallel collectives: a rank's all-gathers queue on one
    stream, its reductions on another, and those crossing nodes all on its one network interface (the simulator's
    model), so the step lasts at least the busiest of them on any rank."""
    gathers = costs.sharding == "full"  # other shardings gather nothing
    bound = 0.0
    for counts in _fsdp_counts(schedule):
        ag = rs = nic = 0.0
        for s, (n_ag, n_rs) in counts.items():
            st = costs.stages[s]
            g, r = n_ag * st.unshard if gathers else 0.0, n_rs * st.reduce
            ag, rs, nic = ag + g, rs + r, nic + (g + r if st.inter_node else 0.0)
        bound = max(bound, ag, rs, nic)
    return bound


def static_fits(model: Model, cluster: Cluster, c: Candidate) -> bool:
    """Cheap pre-filter: the sharded/replicated state of the heaviest rank alone must fit."""
    model_split = c.pipeline_parallel * c.tensor_parallel  # a replica's ways of cutting the model
    local_params = sum(model.layer_params()) / model_split
    experts_elsewhere = sum(model.layer_expert_params()) * (1 - 1 / c.expert_parallel) / model_split
    return state_bytes(local_params, c.sharding, c.gradient_replicas, local_params - experts_elsewhere) \
        < cluster.usable_memory
