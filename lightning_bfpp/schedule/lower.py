"""Lowering passes that turn per-rank compute orders into complete action lists:
FSDP points (unshard with one-interval prefetch, reshard, gradient reduce) and p2p send/receive."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .actions import INPUT_GRAD_OPS, WEIGHT_GRAD_OPS, Action, Op, ScheduleSpec


@dataclass
class _Interval:
    """Compute indices [start, end] during which `stage`'s weights must be gathered."""

    stage: int
    start: int
    end: int


def gathered_intervals(spec: ScheduleSpec, compute: list[Action]) -> list[_Interval]:
    """When each local stage must hold gathered weights, by the reshard policy.

    Keep-gathered (default): from a stage's first to its last compute of each accumulation group, so
    weights are gathered once per group. ``reshard_after_forward``: the forward run and the backward run
    of each group are separate intervals. Overlapping or back-to-back intervals of one stage merge.
    """
    per_group = spec.micro_batches // spec.groups
    spans: dict[tuple, list[int]] = {}
    for i, a in enumerate(compute):
        key = (a.stage, a.micro_batch // per_group) + ((a.op == Op.FORWARD,) if spec.reshard_after_forward else ())
        spans.setdefault(key, [i, i])[1] = i
    intervals = sorted((_Interval(k[0], s, e) for k, (s, e) in spans.items()), key=lambda iv: iv.start)
    merged: list[_Interval] = []
    for iv in intervals:
        same = [m for m in merged if m.stage == iv.stage]
        last = same[-1] if same else None
        if last is not None and iv.start <= _next_other_compute(compute, last.end, iv.stage):
            last.end = max(last.end, iv.end)
        else:
            merged.append(iv)
    return merged


def _next_other_compute(compute: list[Action], after: int, stage: int) -> int:
    """Index of the first compute after `after` that is not on `stage` (len(compute) if none)."""
    for j in range(after + 1, len(compute)):
        if compute[j].stage != stage:
            return j
    return len(compute)


def add_fsdp(spec: ScheduleSpec, compute: list[Action]) -> list[list[Action]]:
    """Per compute action: the FSDP actions to run before it, then itself, then those after it.

    UNSHARD of the next interval is issued when the current one starts (prefetch: the all-gather runs
    while this stage computes); REDUCE_GRAD right after a stage's last backward (or weight-gradient pass);
    RESHARD at interval end.
    """
    intervals = gathered_intervals(spec, compute)
    slots: list[list[Action]] = [[] for _ in compute]
    after: list[list[Action]] = [[] for _ in compute]
    issued: set[int] = set()  # interval ids whose UNSHARD is out
    active: set[int] = set()  # stages gathered (or being gathered) at this point of emission
    starts = defaultdict(list)
    for k, iv in enumerate(intervals):
        starts[iv.start].append(k)
    last_backward = {} if spec.forward_only else {a.stage: i for i, a in enumerate(compute) if a.op in WEIGHT_GRAD_OPS}

    def unshard(k: int, into: list[Action]) -> None:
        if k in issued or intervals[k].stage in active:
            return
        issued.add(k)
        active.add(intervals[k].stage)
        into.append(Action(intervals[k].stage, Op.UNSHARD))

    ends = defaultdict(list)
    for k, iv in enumerate(intervals):
        ends[iv.end].append(k)
    for i, a in enumerate(compute):
        for k in starts[i]:
            unshard(k, slots[i])
            if k + 1 < len(intervals):
                unshard(k + 1, slots[i])
        if last_backward.get(a.stage) == i:
            after[i].append(Action(a.stage, Op.REDUCE_GRAD))
        for k in ends[i]:
            after[i].append(Action(intervals[k].stage, Op.RESHARD))
            active.discard(intervals[k].stage)
            if k + 1 < len(intervals) and k + 1 not in issued and intervals[k + 1].start > i + 1:
                unshard(k + 1, after[i])  # same-stage successor: gather again as soon as freed
    return [before + [a] + post for before, a, post in zip(slots, compute, after)]


def _message(a: Action, spec: ScheduleSpec) -> tuple[int, int, Action, Action] | None:
    """For a compute action that produces data for another rank: (src, dst, send, recv)."""
    src = spec.stage_rank(a.stage)
    if a.op == Op.FORWARD and a.stage + 1 < spec.num_stages:
        peer = a.stage + 1
        send, recv = Action(a.stage, Op.SEND_F, a.micro_batch), Action(peer, Op.RECV_F, a.micro_batch)
    elif a.op in INPUT_GRAD_OPS and a.stage > 0:
        peer = a.stage - 1
        send, recv = Action(a.stage, Op.SEND_B, a.micro_batch), Action(peer, Op.RECV_B, a.micro_batch)
    else:
        return None
    dst = spec.stage_rank(peer)
    return None if dst == src else (src, dst, send, recv)


def lower(spec: ScheduleSpec, compute: dict[int, list[Action]]) -> dict[int, list[Action]]:
    """Complete per-rank action lists: FSDP actions plus p2p sends (right after the producing compute)
    and receives (posted one compute ahead of the consumer, in the sender's order on each rank pair)."""
    channel_sends: dict[tuple[int, int], list[Action]] = defaultdict(list)  # (src, dst) -> recv actions
    for order in compute.values():
        for a in order:
            msg = _message(a, spec)
            if msg:
                channel_sends[(msg[0], msg[1])].append(msg[3])
    position = {recv: (ch, k) for ch, recvs in channel_sends.items() for k, recv in enumerate(recvs)}

    lowered: dict[int, list[Action]] = {}
    for rank, order in compute.items():
        blocks = add_fsdp(spec, order)
        posted: dict[tuple[int, int], int] = defaultdict(int)  # channel -> receives posted so far
        recvs_before: list[list[Action]] = [[] for _ in order]
        for i, a in enumerate(order):
            needed = _needed_recv(a, spec)
            if needed is None:
                continue
            ch, k = position[needed]
            slot = recvs_before[max(i - 1, 0)]
            while posted[ch] <= k:  # keep each rank pair's receives in the sender's order
                slot.append(channel_sends[ch][posted[ch]])
                posted[ch] += 1
        out: list[Action] = []
        for i, (a, block) in enumerate(zip(order, blocks)):
            out += recvs_before[i]
            for b in block:
                out.append(b)
                if b is a and (msg := _message(a, spec)):
                    out.append(msg[2])
        lowered[rank] = out
    return lowered


def _needed_recv(a: Action, spec: ScheduleSpec) -> Action | None:
    """The receive a compute action waits on, if its input comes from another rank."""
    if a.op == Op.FORWARD and a.stage > 0 and spec.stage_rank(a.stage - 1) != spec.stage_rank(a.stage):
        return Action(a.stage, Op.RECV_F, a.micro_batch)
    if (
        a.op in INPUT_GRAD_OPS
        and a.stage + 1 < spec.num_stages
        and spec.stage_rank(a.stage + 1) != spec.stage_rank(a.stage)
    ):
        return Action(a.stage, Op.RECV_B, a.micro_batch)
    return None
