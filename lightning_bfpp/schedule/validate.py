"""Prove a lowered schedule runs: every input is produced before use, every send meets its
receive in order on each rank pair, weights are gathered when computed on, and no rank waits forever."""
from __future__ import annotations

from collections import Counter, defaultdict

from .actions import INPUT_GRAD_OPS, WEIGHT_GRAD_OPS, Action, Op, Schedule, ScheduleError, ScheduleSpec

_RECV_OF_SEND = {Op.SEND_F: (Op.RECV_F, +1), Op.SEND_B: (Op.RECV_B, -1)}


class _Rank:
    def __init__(self, rank: int, actions: list[Action]):
        self.rank, self.actions, self.pc = rank, actions, 0
        self.done: set[tuple[int, Op, int | None]] = set()
        self.gathered: set[int] = set()
        self.posted: set[Action] = set()
        self.backwards: Counter[int] = Counter()

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.actions)


def validate(schedule: Schedule) -> list[tuple[int, Action]]:
    """Simulate all ranks with asynchronous sends and raise ScheduleError on any violation.

    Returns one feasible global execution order as (rank, action) pairs.
    """
    spec = schedule.spec
    if sorted(schedule.actions) != list(range(spec.pipeline_parallel)):
        raise ScheduleError(f"schedule has ranks {sorted(schedule.actions)}, expected 0..{spec.pipeline_parallel - 1}")
    ranks = [_Rank(r, schedule.actions[r]) for r in range(spec.pipeline_parallel)]
    for r in ranks:
        for a in r.actions:
            if spec.stage_rank(a.stage) != r.rank:
                raise ScheduleError(f"rank {r.rank} runs {a}, but stage {a.stage} lives on rank "
                                    f"{spec.stage_rank(a.stage)}")
    run = _Run(spec)
    run.until_done(ranks)
    _check_complete(schedule, ranks, run.sent, run.recvd)
    return run.trace


class _Run:
    """Every rank's actions stepped in turn, each as far as its inputs allow (sends never block)."""

    def __init__(self, spec: ScheduleSpec) -> None:
        self.spec = spec
        self.sent: dict[tuple[int, int], list[Action]] = defaultdict(list)  # channel -> receives the sends pair with
        self.recvd: dict[tuple[int, int], list[Action]] = defaultdict(list)
        self.arrived: set[Action] = set()  # receives whose data has been sent
        self.trace: list[tuple[int, Action]] = []

    def until_done(self, ranks: list[_Rank]) -> None:
        while not all(r.finished for r in ranks):
            progressed, waits = False, {}
            for r in ranks:
                while not r.finished:
                    why = self.step(r)
                    if why:
                        waits[r.rank] = f"{r.actions[r.pc]} waits for {why}"
                        break
                    progressed = True
            if not progressed:
                detail = "; ".join(f"rank {k}: {v}" for k, v in sorted(waits.items()))
                raise ScheduleError(f"schedule {self.spec.name} deadlocks: {detail}")

    def step(self, r: _Rank) -> str | None:
        """Run r's next action if it can; return why not otherwise."""
        a = r.actions[r.pc]
        if a.is_compute:
            waiting = self._compute(r, a)
            if waiting:
                return waiting
        elif a.op in _RECV_OF_SEND:
            self._send(r, a)
        elif a.op in (Op.RECV_F, Op.RECV_B):
            self._post_receive(r, a)
        else:
            self._fsdp(r, a)
        r.done.add((a.stage, a.op, a.micro_batch))
        self.trace.append((r.rank, a))
        r.pc += 1
        return None

    def _compute(self, r: _Rank, a: Action) -> str | None:
        if (a.stage, a.op, a.micro_batch) in r.done:
            raise ScheduleError(f"rank {r.rank} runs {a} twice")
        if a.stage not in r.gathered:
            raise ScheduleError(f"rank {r.rank} computes {a} on stage {a.stage} without gathered weights (UNSHARD)")
        waiting = self._input_ready(r, a)
        if not waiting and a.op in WEIGHT_GRAD_OPS:
            r.backwards[a.stage] += 1
        return waiting

    def _input_ready(self, r: _Rank, a: Action) -> str | None:
        spec, s, mb = self.spec, a.stage, a.micro_batch
        if a.op == Op.BACKWARD_WEIGHT:  # after its own input-gradient pass (which keeps what W needs)
            return None if (s, Op.BACKWARD_INPUT, mb) in r.done else f"its input-gradient pass {s}I{mb}"
        if a.op == Op.FORWARD:
            if s == 0:
                return None
            if spec.stage_rank(s - 1) == r.rank:
                return None if (s - 1, Op.FORWARD, mb) in r.done else f"stage {s - 1} forward of micro-batch {mb}"
            recv = Action(s, Op.RECV_F, mb)
        else:
            if (s, Op.FORWARD, mb) not in r.done:
                return f"its own forward {s}F{mb}"
            if s == spec.num_stages - 1:
                return None
            if spec.stage_rank(s + 1) == r.rank:
                done = any((s + 1, op, mb) in r.done for op in INPUT_GRAD_OPS)
                return None if done else f"stage {s + 1} backward of micro-batch {mb}"
            recv = Action(s, Op.RECV_B, mb)
        if recv not in r.posted:
            return f"receive {recv} (never posted before use)"
        return None if recv in self.arrived else f"data for {recv}"

    def _send(self, r: _Rank, a: Action) -> None:
        producers = (Op.FORWARD,) if a.op == Op.SEND_F else INPUT_GRAD_OPS
        if not any((a.stage, op, a.micro_batch) in r.done for op in producers):
            raise ScheduleError(f"rank {r.rank} sends {a} before computing it")
        recv_op, delta = _RECV_OF_SEND[a.op]
        recv = Action(a.stage + delta, recv_op, a.micro_batch)
        ch = (r.rank, self.spec.stage_rank(recv.stage))
        self.sent[ch].append(recv)
        _check_pairing(ch, self.sent, self.recvd)
        self.arrived.add(recv)

    def _post_receive(self, r: _Rank, a: Action) -> None:
        if a in r.posted:
            raise ScheduleError(f"rank {r.rank} posts {a} twice")
        peer = a.stage - 1 if a.op == Op.RECV_F else a.stage + 1
        ch = (self.spec.stage_rank(peer), r.rank)
        self.recvd[ch].append(a)
        _check_pairing(ch, self.sent, self.recvd)
        r.posted.add(a)

    def _fsdp(self, r: _Rank, a: Action) -> None:
        if a.op == Op.UNSHARD:
            if a.stage in r.gathered:
                raise ScheduleError(f"rank {r.rank} unshards stage {a.stage} twice")
            r.gathered.add(a.stage)
        elif a.op == Op.RESHARD:
            if a.stage not in r.gathered:
                raise ScheduleError(f"rank {r.rank} reshards stage {a.stage} which is not gathered")
            r.gathered.discard(a.stage)
        elif a.op == Op.REDUCE_GRAD and r.backwards[a.stage] != self.spec.micro_batches:
            raise ScheduleError(f"rank {r.rank} reduces gradients of stage {a.stage} after {r.backwards[a.stage]}/"
                                f"{self.spec.micro_batches} backwards")


def _check_pairing(ch, sent, recvd) -> None:
    k = min(len(sent[ch]), len(recvd[ch])) - 1
    if k >= 0 and sent[ch][k] != recvd[ch][k]:
        raise ScheduleError(
            f"on rank pair {ch[0]}->{ch[1]} message #{k} is sent for {sent[ch][k]} but received as {recvd[ch][k]}: "
            "receives must be posted in the sender's order"
        )


def _check_complete(schedule: Schedule, ranks: list[_Rank], sent, recvd) -> None:
    spec = schedule.spec
    for ch in set(sent) | set(recvd):
        if len(sent[ch]) != len(recvd[ch]):
            raise ScheduleError(f"rank pair {ch[0]}->{ch[1]}: {len(sent[ch])} sends but {len(recvd[ch])} receives")
    split = any(a.op == Op.BACKWARD_INPUT for acts in schedule.actions.values() for a in acts)
    backward = (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) if split else (Op.BACKWARD,)
    ops = (Op.FORWARD,) if spec.forward_only else (Op.FORWARD, *backward, Op.REDUCE_GRAD)
    for r in ranks:
        if r.gathered:
            raise ScheduleError(f"rank {r.rank} ends with stages {sorted(r.gathered)} still gathered (missing RESHARD)")
        for s in spec.local_stages(r.rank):
            for op in ops:
                mbs = [None] if op == Op.REDUCE_GRAD else range(spec.micro_batches)
                missing = [mb for mb in mbs if (s, op, mb) not in r.done]
                if missing:
                    raise ScheduleError(f"rank {r.rank} never runs {op.value} of stage {s} for micro-batches {missing}")
