# Scope: compute order per rank (forward/backward of (stage, micro-batch)) for each named schedule,
# and the legality rules of the schedule knobs. Communication is added later by `lower.py`.
from __future__ import annotations

from .actions import LOOPED_SCHEDULES, SCHEDULES, Action, Op, ScheduleError, ScheduleSpec


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
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{n(key)}={value!r} must be a positive integer (>= 1; {hint}); set {n(key)}=1 or more.")
    pp, loops, m, groups = spec.pipeline_parallel, spec.loops, spec.micro_batches, spec.groups
    if spec.name not in LOOPED_SCHEDULES and loops != 1:
        raise ScheduleError(
            f"{n('schedule')}={spec.name} is not looped: {n('loops')}={loops} must be 1 "
            f"(or use {n('schedule')}=breadth_first / depth_first for looped stages)."
        )
    if groups != 1 and spec.name != "breadth_first":
        raise ScheduleError(f"{n('groups')}={groups} (accumulation groups) needs {n('schedule')}=breadth_first; set "
                            f"{n('groups')}=1.")
    if m % groups:
        raise ScheduleError(
            f"{n('micro_batches')}={m} must be divisible by {n('groups')}={groups}; e.g. "
            f"{n('micro_batches')}={-(-m // groups) * groups}, or {n('groups')}=1."
        )
    if spec.name == "depth_first" and loops > 1 and m % pp:
        raise ScheduleError(
            f"{n('schedule')}=depth_first with {n('loops')}={loops} needs {n('micro_batches')} ({m}) divisible by "
            f"{n('pipeline_parallel')} ({pp}); change {n('micro_batches')} (e.g. {n('micro_batches')}={-(-m // pp) * pp})."
        )


def compute_order(spec: ScheduleSpec) -> dict[int, list[Action]]:
    """For each pipeline rank, its forward/backward actions in execution order."""
    check_spec(spec)
    build = {
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
