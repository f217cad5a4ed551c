"""Compute order per rank (forward/backward of (stage, micro-batch)) for each named schedule,
and the legality rules of the schedule knobs. Communication is added later by `lower.py`."""
from __future__ import annotations

from collections import deque

from .actions import BREADTH_FIRST, LOOPED_SCHEDULES, SCHEDULES, Action, Op, ScheduleError, ScheduleSpec
from .checks import is_count


def check_spec(spec: ScheduleSpec, names=None) -> None:
    """Raise ScheduleError naming the setting and the fix when `spec` is not a legal schedule. `names`
    (``dims.Names``): how the caller's users spell the settings (default: BFPPStrategy's arguments)."""
    def n(key: str) -> str:
        return getattr(names, key, key)

    if spec.name not in SCHEDULES:
        raise ScheduleError(f"{n('schedule')}={spec.name!r} is unknown; choose one of {', '.join(SCHEDULES)}.")
    hints = {"pipeline_parallel": "1 = no pipelining", "loops": "1 = one stage per pipeline rank",
             "micro_batches": "usually a multiple of pipeline_parallel", "groups": "1 = one breadth-first pass"}
    for key, hint in hints.items():
        value = getattr(spec, key)
        if not is_count(value):
            raise ScheduleError(f"{n(key)}={value!r} must be a positive integer (>= 1; {hint}); set {n(key)}=1 or "
                                "more.")
    pp, loops, m, groups = spec.pipeline_parallel, spec.loops, spec.micro_batches, spec.groups
    if spec.name not in LOOPED_SCHEDULES and loops != 1:
        raise ScheduleError(
            f"{n('schedule')}={spec.name} is not looped: {n('loops')}={loops} must be 1 "
            f"(or use {n('schedule')}={' / '.join(LOOPED_SCHEDULES)} for looped stages)."
        )
    if groups != 1 and spec.name not in BREADTH_FIRST:
        raise ScheduleError(f"{n('groups')}={groups} (accumulation groups) needs {n('schedule')}="
                            f"{' or '.join(BREADTH_FIRST)}; set {n('groups')}=1.")
    if m % groups:
        raise ScheduleError(
            f"{n('micro_batches')}={m} must be divisible by {n('groups')}={groups}; e.g. "
            f"{n('micro_batches')}={-(-m // groups) * groups}, or {n('groups')}=1."
        )
    if spec.name == "depth_first" and loops > 1 and m % pp:
        raise ScheduleError(
            f"{n('schedule')}=depth_first with {n('loops')}={loops} needs {n('micro_batches')} ({m}) divisible by "
            f"{n('pipeline_parallel')} ({pp}); change {n('micro_batches')} (e.g. "
            f"{n('micro_batches')}={-(-m // pp) * pp})."
        )


def compute_order(spec: ScheduleSpec) -> dict[int, list[Action]]:
    """For each pipeline rank, its forward/backward actions in execution order."""
    check_spec(spec)
    if spec.name == "breadth_first_zb" and not spec.forward_only:
        return _breadth_first_zb(spec)
    build = {
        "breadth_first_zb": _breadth_first,  # forward only: breadth-first's forwards
        "breadth_first": _breadth_first,
        "gpipe": _breadth_first,  # one stage per rank: all forwards, then all backwards
        "1f1b": _one_f_one_b,
        "depth_first": _depth_first,
    }[spec.name]
    return {rank: build(spec, rank) for rank in range(spec.pipeline_parallel)}


def _breadth_first(spec: ScheduleSpec, rank: int) -> list[Action]:
    """Earliest stage first: each local stage runs all micro-batches of a group before the next stage."""
    stages = spec.local_stages(rank)
    per_group = spec.micro_batches // spec.groups
    order: list[Action] = []
    for g in range(spec.groups):
        mbs = range(g * per_group, (g + 1) * per_group)
        order += [Action(s, Op.FORWARD, mb) for s in stages for mb in mbs]
        if not spec.forward_only:
            order += [Action(s, Op.BACKWARD, mb) for s in reversed(stages) for mb in mbs]
    return order


def _breadth_first_zb(spec: ScheduleSpec) -> dict[int, list[Action]]:
    """Breadth-first with each backward split (zero bubble, Qi et al. 2024) into its input-gradient pass I, which the
    previous stage waits for, and its weight-gradient pass W, which nothing waits for. Each rank keeps breadth-first's
    order of forwards and I passes, with one freedom: on its last local stage of a group (whose backward follows its
    forwards at once, so its weights stay gathered either way) an I runs as soon as its input is there, between the
    remaining forwards. A W waits until the rank would otherwise idle (oldest first), or until the rank would start the
    next accumulation group (a group's W passes end before the next group's first forward: they hold its activations,
    so groups divide the activation memory as they do in breadth-first); the rest follow the rank's last I. The order
    is found by playing all ranks with unit times (F = I = W = 1) and instant messages, except on the first stage: its
    input needs no gradient, so torch's I there does nothing and its W the whole backward (I = 0, W = 2; ``sim.cost``
    times it so too)."""
    pp, last = spec.pipeline_parallel, spec.num_stages - 1
    todo = {r: [Action(a.stage, Op.BACKWARD_INPUT if a.op == Op.BACKWARD else a.op, a.micro_batch)
                for a in _breadth_first(spec, r)] for r in range(pp)}
    last_local = {r: spec.local_stages(r)[-1] for r in range(pp)}
    first_local, per_group = {r: spec.local_stages(r)[0] for r in range(pp)}, spec.micro_batches // spec.groups
    # each rank's list is read through two cursors (linear time at any number of micro-batches): `head`, its first
    # action not taken, and `first_i`, its last local stage's first I not taken (taken in order, so it only advances)
    taken = {r: [False] * len(todo[r]) for r in range(pp)}
    head, first_i = dict.fromkeys(range(pp), 0), dict.fromkeys(range(pp), 0)
    finished: dict[tuple[Op, int, int | None], int] = {}  # (op, stage, micro-batch) -> the tick it ends
    order: dict[int, list[Action]] = {r: [] for r in range(pp)}
    deferred: dict[int, deque[Action]] = {r: deque() for r in range(pp)}

    def ready(a: Action, tick: int) -> bool:
        if a.op == Op.FORWARD:
            need = [(Op.FORWARD, a.stage - 1, a.micro_batch)] if a.stage > 0 else []
        else:
            need = [(Op.FORWARD, a.stage, a.micro_batch)]
            need += [(Op.BACKWARD_INPUT, a.stage + 1, a.micro_batch)] if a.stage < last else []
        return all(finished.get(k, tick + 1) <= tick for k in need)

    def next_i(r: int, stage: int) -> int:
        i, acts = first_i[r], todo[r]
        while taken[r][i] or acts[i].op != Op.BACKWARD_INPUT or acts[i].stage != stage:
            i += 1
        first_i[r] = i
        return i

    def pick(r: int, tick: int) -> int | None:
        h = todo[r][head[r]]
        if h.op == Op.FORWARD and h.stage == last_local[r]:  # an I of this stage may overtake its forwards
            i = next_i(r, h.stage)
            if ready(todo[r][i], tick):
                return i
        return head[r] if ready(h, tick) else None

    def starts_a_group(a: Action, r: int) -> bool:
        return a.op == Op.FORWARD and a.stage == first_local[r] and a.micro_batch % per_group == 0 and a.micro_batch > 0

    def take(r: int, i: int) -> Action:
        taken[r][i] = True
        while head[r] < len(todo[r]) and taken[r][head[r]]:
            head[r] += 1
        return todo[r][i]

    def ticks(a: Action) -> int:
        return 1 if a.stage > 0 or a.op == Op.FORWARD else 0 if a.op == Op.BACKWARD_INPUT else 2

    tick, free_at = 0, dict.fromkeys(range(pp), 0)
    while any(head[r] < len(todo[r]) for r in range(pp)):
        for r in range(pp):
            while tick >= free_at[r]:  # a first-stage I takes no time: the rank goes on in the same tick
                i = pick(r, tick) if head[r] < len(todo[r]) else None
                if i is not None and deferred[r] and starts_a_group(todo[r][i], r):
                    i = None  # the last group's weight passes first
                if i is not None:
                    a = take(r, i)
                    if a.op == Op.BACKWARD_INPUT:
                        deferred[r].append(Action(a.stage, Op.BACKWARD_WEIGHT, a.micro_batch))
                elif deferred[r]:
                    a = deferred[r].popleft()
                else:
                    break
                order[r].append(a)
                free_at[r] = finished[(a.op, a.stage, a.micro_batch)] = tick + ticks(a)
        tick += 1
    return {r: order[r] + list(deferred[r]) for r in range(pp)}


def _interleave_1f1b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[len(forwards) - warmup :]


def _one_f_one_b(spec: ScheduleSpec, rank: int) -> list[Action]:
    """One forward, one backward in steady state; warm-up of pp - rank - 1 forwards."""
    m = spec.micro_batches
    forwards = [Action(rank, Op.FORWARD, mb) for mb in range(m)]
    if spec.forward_only:
        return forwards
    backwards = [Action(rank, Op.BACKWARD, mb) for mb in range(m)]
    return _interleave_1f1b(forwards, backwards, spec.pipeline_parallel - rank - 1)


def _depth_first(spec: ScheduleSpec, rank: int) -> list[Action]:
    """Earliest micro-batch first (Megatron's interleaved 1F1B): micro-batches go through all local
    stages in blocks of pp, forward and backward interleaved after a warm-up."""
    pp, loops, m = spec.pipeline_parallel, spec.loops, spec.micro_batches
    if loops == 1:
        return _one_f_one_b(spec, rank)
    total = m * loops

    def chunk_and_mb(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // pp) % loops
        return (loops - 1 - chunk if backward else chunk), (k // (pp * loops)) * pp + k % pp

    def stage(chunk: int) -> int:
        return chunk * pp + rank

    forwards = [Action(stage(c), Op.FORWARD, mb) for c, mb in (chunk_and_mb(k, False) for k in range(total))]
    if spec.forward_only:
        return forwards
    backwards = [Action(stage(c), Op.BACKWARD, mb) for c, mb in (chunk_and_mb(k, True) for k in range(total))]
    return _interleave_1f1b(forwards, backwards, (pp - rank - 1) * 2 + (loops - 1) * pp)
