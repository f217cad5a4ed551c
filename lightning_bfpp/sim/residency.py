"""FSDP weight residency as a cost-model choice for any schedule — how long a rank keeps a local
stage's gathered (bf16) weights. "step" is the schedule's own lowering (what the runtime runs: every local
stage gathered from its first to its last compute of an accumulation group); "cache" keeps at most
`cache` stages gathered (least recently used evicted, regathered when needed again); "run" regathers for
every run of consecutive computes on a stage (one micro-batch in 1F1B's steady state). Outside "step" a
stage's unsharded gradient is reduce-scattered whenever it leaves memory after backwards (FSDP without
no-sync), so memory saved on weights and gradients is paid for in all-gathers and reduce-scatters."""
from __future__ import annotations

from collections import defaultdict

from ..schedule import FSDP_OPS, Action, Op, Schedule
from ..schedule.actions import WEIGHT_GRAD_OPS

RESIDENCIES = ("step", "cache", "run")


def intervals(compute: list[Action], residency: str, cache: int = 2) -> list[tuple[int, int, int]]:
    """(stage, first, last) compute indices during which a stage is gathered, ordered by first index."""
    if residency == "run":
        out: list[tuple[int, int, int]] = []
        for i, a in enumerate(compute):
            if out and out[-1][0] == a.stage and out[-1][2] == i - 1:
                out[-1] = (a.stage, out[-1][1], i)
            else:
                out.append((a.stage, i, i))
        return out
    if residency != "cache" or cache < 1:
        raise ValueError(f"residency={residency!r} (cache={cache}) must be 'run' or 'cache' with cache >= 1 "
                         "('step' is the schedule's own lowering).")
    open_: dict[int, list[int]] = {}  # stage -> [first, last] of its open interval (insertion order = LRU order)
    closed: list[tuple[int, int, int]] = []
    for i, a in enumerate(compute):
        if a.stage in open_:
            span = open_.pop(a.stage)  # re-insert: most recently used last
            span[1] = i
        else:
            if len(open_) == cache:
                victim = next(iter(open_))
                closed.append((victim, *open_.pop(victim)))
            span = [i, i]
        open_[a.stage] = span
    closed += [(s, f, e) for s, (f, e) in open_.items()]
    return sorted(closed, key=lambda iv: iv[1])


def _fsdp_points(compute: list[Action],
                 spans: list[tuple[int, int, int]]) -> tuple[list[list[Action]], list[list[Action]]]:
    """FSDP actions before and after each compute: the next interval's all-gather is issued when the current
    one starts (one-interval prefetch, as the schedule's lowering), or when its stage is freed; gradients are
    reduce-scattered at the end of every interval that ran a backward; weights freed at interval end."""
    before: list[list[Action]] = [[] for _ in compute]
    after: list[list[Action]] = [[] for _ in compute]
    issued, active = set(), set()
    starts, ends = defaultdict(list), defaultdict(list)
    for k, (_, first, last) in enumerate(spans):
        starts[first].append(k)
        ends[last].append(k)

    def unshard(k: int, into: list[Action]) -> None:
        if k < len(spans) and k not in issued and spans[k][0] not in active:
            issued.add(k)
            active.add(spans[k][0])
            into.append(Action(spans[k][0], Op.UNSHARD))

    for i in range(len(compute)):
        for k in starts[i]:
            unshard(k, before[i])
            unshard(k + 1, before[i])
        for k in ends[i]:
            stage, first, last = spans[k]
            if any(compute[j].op in WEIGHT_GRAD_OPS for j in range(first, last + 1) if compute[j].stage == stage):
                after[i].append(Action(stage, Op.REDUCE_GRAD))
            after[i].append(Action(stage, Op.RESHARD))
            active.discard(stage)
            unshard(k + 1, after[i])
    return before, after


def relower(schedule: Schedule, residency: str, cache: int = 2) -> Schedule:
    """`schedule` with its FSDP actions re-placed for `residency` (p2p and compute order untouched).

    NOTE: for the simulator and planner only: the runtime executes the schedule's own ("step") lowering, and
    the validator's one-REDUCE_GRAD-per-stage rule does not hold here (a stage may reduce several times).
    """
    if residency == "step":
        return schedule
    actions = {}
    for rank, lowered in schedule.actions.items():
        kept = [a for a in lowered if a.op not in FSDP_OPS]
        compute = [a for a in kept if a.is_compute]
        before, after = _fsdp_points(compute, intervals(compute, residency, cache))
        out, i = [], -1
        for a in kept:
            if a.is_compute:
                if i >= 0:
                    out += after[i]
                i += 1
                out += before[i]
            out.append(a)
        actions[rank] = out + (after[i] if i >= 0 else [])
    return Schedule(schedule.spec, actions)
