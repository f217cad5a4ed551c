"""A measured training step as a Chrome trace: the trace event JSON that Perfetto (ui.perfetto.dev) and
chrome://tracing open. One process per rank with three tracks: "step" (the step's span), "compute" (each forward,
backward, input pass and weight pass, as the step's timeline measured them: the same spans ``step_stats`` counts) and
"actions" (every action torch's runtime ran on the rank: sends, receives, gathers, reshards, gradient reductions, and
each compute action with its waits for its input and its weights). Times are microseconds from each rank's own step
start (ranks start a step together: the previous step ended in a collective over all of them)."""
from __future__ import annotations

from typing import Any

from ..dims import ParallelDims
from .instrument import Timeline

KINDS = {"F": "forward", "B": "backward", "I": "input pass", "W": "weight pass", "UNSHARD": "all-gather",
         "RESHARD": "reshard", "REDUCE_GRAD": "gradient reduction", "SEND_F": "send activation",
         "RECV_F": "receive activation", "SEND_B": "send gradient", "RECV_B": "receive gradient"}
TRACKS = {"step": 0, "compute": 1, "actions": 2}


def rank_record(timeline: Timeline) -> dict[str, Any]:
    """This rank's last measured step (``Timeline.span`` set): its span and events in seconds from its start."""
    if timeline.span is None:
        raise ValueError("no measured step: the timeline records only measured steps (measure_every_n_steps)")
    start, end = timeline.span
    return {"span_s": end - start,
            "compute": [(kind, stage, mb, a - start, b - start) for kind, stage, mb, a, b in timeline.events],
            "actions": [(kind, stage, mb, a - start, b - start) for kind, stage, mb, a, b in timeline.actions]}


def _name(kind: str, stage: int, micro_batch: int | None) -> str:
    """torch's notation: "2F1" (stage 2, forward, micro-batch 1), "0UNSHARD"."""
    return f"{stage}{kind}{'' if micro_batch is None else micro_batch}"


def _event(rank: int, track: str, kind: str, stage: int, micro_batch: int | None, start: float,
           end: float) -> dict[str, Any]:
    return {"name": _name(kind, stage, micro_batch), "cat": KINDS.get(kind, kind), "ph": "X", "pid": rank,
            "tid": TRACKS[track], "ts": round(start * 1e6, 3), "dur": round((end - start) * 1e6, 3),
            "args": {"stage": stage, "micro_batch": micro_batch, "what": KINDS.get(kind, kind)}}


def chrome_trace(records: dict[int, dict[str, Any]], dims: ParallelDims, *, step: int,
                 title: str = "") -> dict[str, Any]:
    """The Chrome trace of one measured step from every rank's `rank_record` ({global rank: record})."""
    events: list[dict[str, Any]] = []
    for rank, record in sorted(records.items()):
        at = dims.coordinates(rank)
        where = f"pipeline {at.pipeline}, replica {at.data}"
        where += (f", cp {at.context}" if dims.context_parallel > 1 else "") + \
            (f", tp {at.tensor}" if dims.tensor_parallel > 1 else "")
        label = f"rank {rank} ({where})"
        events += [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": label}},
                   {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
        events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}}
                   for track, tid in TRACKS.items()]
        events.append({"name": f"step {step}", "cat": "step", "ph": "X", "pid": rank, "tid": TRACKS["step"], "ts": 0,
                       "dur": round(record["span_s"] * 1e6, 3)})
        events += [_event(rank, "compute", *e) for e in record["compute"]]
        events += [_event(rank, "actions", *e) for e in record["actions"]]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step": step, "schedule": title, "world_size": dims.world}}


def busy_fractions(trace: dict[str, Any]) -> dict[int, float]:
    """Per rank (pid), the part of its step its compute track is busy: what a trace shows as the rank's use."""
    span: dict[int, float] = {}
    busy: dict[int, float] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        if e["tid"] == TRACKS["step"]:
            span[e["pid"]] = e["dur"]
        elif e["tid"] == TRACKS["compute"]:
            busy[e["pid"]] = busy.get(e["pid"], 0.0) + e["dur"]
    return {rank: busy.get(rank, 0.0) / d for rank, d in span.items() if d > 0}
