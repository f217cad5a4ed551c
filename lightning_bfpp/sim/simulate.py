"""Discrete-event simulation of one training step. Plays exactly the per-rank action lists of
`build_schedule(spec).actions` (the lists the runtime executes) against `cost.Costs`: one compute
stream per pipeline rank plus an all-gather stream, a reduce stream and one p2p link per rank pair; all
inter-node transfers of a rank (its dp collectives, its outgoing pipeline messages) share one network
interface: collectives queue on it in issue order, and a pipeline message (small, latency-bound) goes
first, pushing the collectives in flight back by its own transfer time (the bytes still cross one wire). Data-parallel
and tensor-parallel peers are symmetric, so only the pp ranks of one replica's first tp slice are simulated."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..schedule import Op, Schedule, ScheduleError
from .cost import Costs, rank_state_bytes
from .memory import MemoryReport, memory_report


@dataclass(frozen=True)
class SimOptions:
    """How the runtime waits. Defaults: FSDP2-style (async all-gather and reduce-scatter streams, async p2p).

    Attributes:
        blocking_p2p: the sender's compute stream waits for its message to arrive (Megatron-style p2p).
        reduce_at_end: gradient reductions run after the whole pipeline flush, one after the other
            (Megatron-LM's data-parallel all-reduce), instead of at each REDUCE_GRAD.
        blocking_reduce: the rank waits for each REDUCE_GRAD to finish (the CPU/gloo runtime does).
        expert_overlap: a micro-batch's expert all-to-alls (``StageCost.a2a_forward`` / ``a2a_backward``) run while
            the rank computes its next action when that is another micro-batch's (in a breadth-first pass: the
            same stage's next micro-batch; DualPipe's and Megatron's combined 1F1B overlap a forward with another
            micro-batch's backward the same way); only what that compute does not cover is exposed. Off: every
            all-to-all is on the critical path (the runtime today).
        cross_step_overlap: the runtime's ``cross_step_overlap``: the step's first all-gathers started right after
            the previous optimizer step (once every rank's last compute is done and the first rank's gradients are
            reduced) instead of at this step's start, so they overlap what separates the two: the host time between
            steps (``Costs.step_overhead``, taken to follow the optimizer step) and other ranks' last reductions. The
            step is shorter by that head start, at most the first rank's wait for its first gather
            (``SimResult.cross_step_gain``). Steady state: every step follows another.
    """

    blocking_p2p: bool = False
    reduce_at_end: bool = False
    blocking_reduce: bool = False
    expert_overlap: bool = False
    cross_step_overlap: bool = False


MEGATRON = SimOptions(blocking_p2p=True, reduce_at_end=True)


class Event(NamedTuple):
    """One interval on a rank's timeline. kind: F, B, I, W (compute), UNSHARD, REDUCE, SEND_F, SEND_B (comm)."""

    rank: int
    kind: str
    stage: int
    micro_batch: int | None
    start: float
    end: float


@dataclass
class SimResult:
    """Predicted step of one data-parallel replica (pp ranks)."""

    schedule: Schedule
    step_time: float
    timeline: list[Event]
    busy: list[float]  # compute seconds per pipeline rank
    memory: list[MemoryReport]  # per pipeline rank
    tokens_per_step: int  # per replica
    pipeline_bubble: float | None = None  # bubble of the same step with free communication
    comm_free_step_time: float | None = None
    tensor_parallel: int = 1  # devices per simulated pipeline rank (tp x cp)
    cross_step_gain: float = 0.0  # seconds cross-step overlap takes (or would take) off the step

    @property
    def bubble(self) -> float:
        """Idle compute time / busy compute time over all ranks (pipeline bubble + exposed comm)."""
        busy = sum(self.busy)
        return (len(self.busy) * self.step_time - busy) / busy if busy else 0.0

    @property
    def exposed_comm(self) -> float | None:
        """Seconds the step loses to communication (step time minus the comm-free step time)."""
        return None if self.comm_free_step_time is None else self.step_time - self.comm_free_step_time

    @property
    def tokens_per_second_per_device(self) -> float:
        devices = len(self.busy) * self.tensor_parallel
        return self.tokens_per_step / self.step_time / devices if self.step_time else 0.0

    @property
    def peak_memory(self) -> float:
        return max(m.peak for m in self.memory)

    def rank_timeline(self, rank: int) -> list[Event]:
        return [e for e in self.timeline if e.rank == rank]


class _Rank:
    __slots__ = ("rank", "program", "pc", "host", "ag_free", "rs_free", "nic", "ag_stage", "ready", "busy", "deferred",
                 "mem", "grads", "first_compute", "gathering")

    def __init__(self, rank: int, program):
        self.rank, self.program, self.pc = rank, program, 0
        self.first_compute: float | None = None  # when the rank's first compute starts
        self.host = self.ag_free = self.rs_free = self.busy = 0.0
        self.nic = 0.0  # time the rank's network interface is free of collectives (inter-node transfers only)
        self.ag_stage = -1  # stage of the last inter-node all-gather
        self.ready: dict[int, float] = {}  # stage -> time its gathered weights are usable (its first unit's)
        self.gathering: dict[int, tuple[float, float]] = {}  # stage in units -> (gather start, last unit's end)
        self.deferred: list[int] = []
        self.mem: list[tuple[float, float, str]] = []  # (time, bytes delta, category)
        self.grads: set[int] = set()  # stages holding an unsharded gradient


_F, _B, _I, _W, _SEND, _UNSHARD, _RESHARD, _REDUCE = range(8)
_KIND = {_F: "F", _B: "B", _I: "I", _W: "W"}


def _compile(schedule: Schedule) -> list[list[tuple]]:
    """Per rank, the actions as tuples the simulator can play fast (receives are only posting points:
    the consuming compute waits for the data); a compute ends with the rank's next compute (code, stage) when that is
    another micro-batch's (the work its all-to-alls may hide behind), else None. Cached on the schedule object."""
    cached = schedule.__dict__.get("_sim_program")
    if cached is not None:
        return cached
    spec = schedule.spec
    last = spec.num_stages - 1
    programs = []
    for rank in range(spec.pipeline_parallel):
        prog = []
        for a in schedule.actions[rank]:
            op, s, mb = a.op, a.stage, a.micro_batch
            if op is Op.FORWARD or op is Op.BACKWARD or op is Op.BACKWARD_INPUT:
                fwd = op is Op.FORWARD
                need = None if (s == 0 if fwd else s == last) else (s, fwd, mb)
                nxt = s + 1 if fwd else s - 1
                local = (nxt, fwd, mb) if 0 <= nxt <= last and spec.stage_rank(nxt) == rank else None
                prog.append([_F if fwd else _B if op is Op.BACKWARD else _I, s, mb, need, local, None])
            elif op is Op.BACKWARD_WEIGHT:  # after its own I, on this rank
                prog.append([_W, s, mb, (s, "W", mb), None, None])
            elif op is Op.SEND_F or op is Op.SEND_B:
                fwd = op is Op.SEND_F
                dst = s + 1 if fwd else s - 1
                prog.append((_SEND, s, mb, (rank, spec.stage_rank(dst)), (dst, fwd, mb), op.value))
            elif op is Op.UNSHARD:
                prog.append((_UNSHARD, s))
            elif op is Op.RESHARD:
                prog.append((_RESHARD, s))
            elif op is Op.REDUCE_GRAD:
                prog.append((_REDUCE, s))
        computes = [a for a in prog if isinstance(a, list)]
        for a, b in zip(computes, computes[1:]):
            a[5] = (b[0], b[1]) if b[2] != a[2] else None
        programs.append([tuple(a) for a in prog])
    schedule.__dict__["_sim_program"] = programs
    return programs


def simulate(schedule: Schedule, costs: Costs, options: SimOptions = SimOptions(), *,
             timeline: bool = True) -> SimResult:
    """Play `schedule` against `costs`; raise ScheduleError if the lists cannot make progress."""
    spec = schedule.spec
    if len(costs.stages) != spec.num_stages:
        raise ValueError(f"costs describe {len(costs.stages)} stages but the schedule has {spec.num_stages}.")
    play = _Play(schedule, costs, options, timeline)
    play.run_all()
    return play.result()


class _Play:
    """One simulated step: the ranks' state, the data each compute waits for, the p2p links' free times."""

    def __init__(self, schedule: Schedule, costs: Costs, options: SimOptions, timeline: bool):
        self.schedule, self.costs, self.options = schedule, costs, options
        self.stages, self.full = costs.stages, costs.sharding == "full"
        self.ranks = [_Rank(r, prog) for r, prog in enumerate(_compile(schedule))]
        self.inputs: dict[tuple, float] = {}  # (stage, is_forward, mb) -> time the compute's input is on its rank
        self.links: dict[tuple[int, int], float] = {}  # (src, dst) -> time the link is free
        self.events: list[Event] | None = [] if timeline else None

    def run_all(self) -> None:
        """Round-robin over the ranks until every list is played (each rank runs until it waits on data)."""
        pending = list(self.ranks)
        while pending:
            progressed = False
            for r in pending:
                progressed |= self.run(r)
            if not progressed:
                stuck = "; ".join(f"rank {r.rank} at action #{r.pc}" for r in pending)
                raise ScheduleError(f"simulation of {self.schedule.spec.name} cannot progress: {stuck}")
            pending = [r for r in pending if r.pc < len(r.program)]
        for r in self.ranks:  # Megatron-style: reductions after the flush, one after the other
            for s in r.deferred:
                r.rs_free = max(r.rs_free, r.host)
                self.reduce(r, s)

    def run(self, r: _Rank) -> bool:
        """Play r's actions until one waits on data not yet produced; return whether any ran."""
        start = r.pc
        while r.pc < len(r.program):
            a = r.program[r.pc]
            code = a[0]
            if code <= _W:
                if not self.compute(r, a):
                    break
            elif code == _SEND:
                self.send(r, a)
            elif code == _UNSHARD:
                self.unshard(r, a[1])
            elif code == _RESHARD:
                if self.full:
                    st = self.stages[a[1]]
                    r.mem.append((r.host, -st.weight_bytes * st.gathered_params, "weights"))
            elif code == _REDUCE:
                r.host += self.stages[a[1]].reduce_host  # the runtime scales the stage's gradients on the host first
                if self.options.reduce_at_end:
                    r.deferred.append(a[1])
                else:
                    self.reduce(r, a[1])
                    if self.options.blocking_reduce:
                        r.host = r.rs_free
            r.pc += 1
        return r.pc > start

    def compute(self, r: _Rank, a: tuple) -> bool:
        """A forward or backward: starts when the host, its weights and its input are ready; False if the
        input is not produced yet. Records activation, workspace, unsharded-gradient and weight-pass bytes."""
        code, s, mb, need, local, hide = a
        if need is None:
            t_in = 0.0
        elif need in self.inputs:
            t_in = self.inputs[need]
        else:
            return False
        st = self.stages[s]
        t0 = max(r.host, r.ready.get(s, 0.0), t_in)
        if code != _F and s in r.gathering:  # a backward runs the last layer first: it waits for the whole gather
            t0 = max(t0, r.gathering[s][1])
        compute = self._compute_time(st, code)
        exposed = self._a2a(st, code)  # its expert all-to-alls, or what the next micro-batch's compute leaves of them
        if exposed and hide is not None and self.options.expert_overlap:
            exposed = max(0.0, exposed - self._compute_time(self.stages[hide[1]], hide[0]))
        dur = compute + exposed
        if code == _F and s in r.gathering and t0 < r.gathering[s][1]:  # layers computing as their weights arrive
            dur = _on_arrival(st, t0, dur, *r.gathering[s]) - t0
        if code == _F:
            r.mem.append((t0, st.activation, "activations"))
            if self.schedule.spec.forward_only:
                r.mem.append((t0 + dur, -st.activation, "activations"))
        else:  # a backward, or its input part I (the activations stay for W) or its weight part W
            if code == _I:  # what it keeps for W stays until W ends
                self.inputs[(s, "W", mb)] = t0 + dur
                r.mem.append((t0 + dur, st.weight_pass_bytes, "weight_pass"))
            else:
                r.mem.append((t0 + dur, -st.activation, "activations"))
                if code == _W:
                    r.mem.append((t0 + dur, -st.weight_pass_bytes, "weight_pass"))
            if st.workspace:
                r.mem += [(t0, st.workspace, "workspace"), (t0 + dur, -st.workspace, "workspace")]
            if self.full and s not in r.grads:
                r.grads.add(s)
                r.mem.append((t0, st.grad_bytes * st.gathered_params, "gradients"))
        if r.first_compute is None:
            r.first_compute = t0
        r.host = t0 + dur
        r.busy += compute
        if self.events is not None:
            self.events.append(Event(r.rank, _KIND[code], s, mb, t0, r.host))
        if local is not None:
            self.inputs[local] = r.host
        return True

    @staticmethod
    def _compute_time(st, code: int) -> float:
        if code == _F:
            return st.forward
        return st.backward * (1 - st.weight_fraction if code == _I else st.weight_fraction if code == _W else 1)

    @staticmethod
    def _a2a(st, code: int) -> float:
        """Seconds of a compute action's expert all-to-alls (a split backward's are in its input part)."""
        return st.a2a_forward if code == _F else 0.0 if code == _W else st.a2a_backward

    def send(self, r: _Rank, a: tuple) -> None:
        """A pipeline message on its rank pair's link (in order); an inter-node one shares the interface."""
        _, s, mb, link, produced, kind = a
        t0 = max(r.host, self.links.get(link, 0.0))
        t1 = t0 + self.costs.p2p_time(*link)
        self.links[link] = t1
        if link in self.costs.p2p_inter and r.nic > t0:
            _share_nic(r, t0, t1 - t0)
        self.inputs[produced] = t1
        if self.events is not None and t1 > t0:
            self.events.append(Event(r.rank, kind, s, mb, t0, t1))
        if self.options.blocking_p2p:
            r.host = t1

    def unshard(self, r: _Rank, s: int) -> None:
        """All-gather of a stage's weights on the gather stream (and the interface when it crosses nodes)."""
        if not self.full:
            r.ready[s] = 0.0
            return
        st = self.stages[s]
        t0 = max(r.host, r.ag_free, r.nic if st.inter_node else 0.0)
        r.ag_free = r.ready[s] = t0 + st.unshard
        if st.unit_gather:  # one unit per layer: the stage's first layer computes once its own weights arrived
            r.ready[s] = t0 + st.unit_gather[0]
            r.gathering[s] = (t0, r.ag_free)
        if st.inter_node:
            r.nic, r.ag_stage = r.ag_free, s
        r.mem.append((t0, st.weight_bytes * st.gathered_params, "weights"))
        if self.events is not None and st.unshard:
            self.events.append(Event(r.rank, "UNSHARD", s, None, t0, r.ag_free))

    def reduce(self, r: _Rank, s: int) -> None:
        """Gradient reduction of a stage on the reduce stream (and the interface); frees its unsharded grads."""
        st = self.stages[s]
        t0 = max(r.host, r.rs_free, r.nic if st.inter_node else 0.0)
        r.rs_free = t0 + st.reduce
        if st.inter_node:
            r.nic = r.rs_free
        if self.events is not None and st.reduce:
            self.events.append(Event(r.rank, "REDUCE", s, None, t0, r.rs_free))
        if self.full and s in r.grads:
            r.grads.discard(s)
            r.mem.append((r.rs_free, -st.grad_bytes * st.gathered_params, "gradients"))

    def result(self) -> SimResult:
        """Step time: the last of every rank's host (+ per-step overhead), streams and outgoing links."""
        link_end: dict[int, float] = {}
        for (src, _), t in self.links.items():  # a rank's last message may be on any of its links
            link_end[src] = max(link_end.get(src, 0.0), t)
        ends = [max(r.host + self.costs.step_overhead, r.ag_free, r.rs_free, link_end.get(r.rank, 0.0))
                for r in self.ranks]
        spec = self.schedule.spec
        memory = [memory_report(r.mem, rank_state_bytes(spec.local_stages(r.rank), self.costs)) for r in self.ranks]
        step = max(ends)
        # Cross-step overlap: the first rank's first forward waits for its gathered weights (its input is the batch);
        # issued right after the optimizer step, that gather starts once every rank's last compute is done (the
        # shared loss) and the first rank's gradients are reduced (its update), not at the next step's start
        first = self.ranks[0]
        started = max(max(r.host for r in self.ranks), first.rs_free)
        gain = max(0.0, min(first.first_compute or 0.0, step - started))
        step -= gain if self.options.cross_step_overlap else 0.0
        return SimResult(self.schedule, step, self.events or [], [r.busy for r in self.ranks], memory,
                         self.costs.tokens_per_step, tensor_parallel=self.costs.tensor_parallel, cross_step_gain=gain)


def _on_arrival(st, start: float, dur: float, gather_start: float, gather_end: float) -> float:
    """When a compute of `dur` seconds starting at `start` ends if each layer (``st.unit_share`` of it) waits for its
    own weights, which arrive in order over [gather_start, gather_end] (``st.unit_gather``'s shares of it)."""
    t, arrived, scale = start, gather_start, (gather_end - gather_start) / (sum(st.unit_gather) or 1.0)
    for gather, share in zip(st.unit_gather, st.unit_share):
        arrived += gather * scale
        t = max(t, arrived) + share * dur
    return t


def _share_nic(r: _Rank, t: float, delay: float) -> None:
    """A pipeline message of `delay` seconds crosses the interface at `t`: inter-node collectives still in
    flight finish that much later."""
    if r.ag_stage >= 0 and r.ag_free > t:
        r.ag_free += delay
        if r.ag_stage in r.gathering:  # its layers' weights arrive that much later, the first one's at most
            start, _ = r.gathering[r.ag_stage]
            r.gathering[r.ag_stage] = (start, r.ag_free)
            r.ready[r.ag_stage] = min(r.ready[r.ag_stage] + delay, r.ag_free)
        else:
            r.ready[r.ag_stage] = r.ag_free
    if r.rs_free > t:
        r.rs_free += delay
    r.nic += delay


def evaluate(schedule: Schedule, costs: Costs, options: SimOptions = SimOptions(), *,
             timeline: bool = True) -> SimResult:
    """`simulate`, plus the comm-free run that gives the pure pipeline bubble and the exposed comm time."""
    result = simulate(schedule, costs, options, timeline=timeline)
    free = simulate(schedule, costs.without_comm(), SimOptions(), timeline=False)
    result.comm_free_step_time = free.step_time
    result.pipeline_bubble = free.bubble
    return result
