"""The vocabulary of a schedule — what one rank does, in order, during one training step.
Pure Python: no torch, no process group. Generators, lowering, validator, simulator and the
runtime all speak this one language."""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from enum import Enum

SCHEDULES = ("breadth_first", "depth_first", "gpipe", "1f1b", "breadth_first_zb")
LOOPED_SCHEDULES = ("breadth_first", "depth_first", "breadth_first_zb")
BREADTH_FIRST = ("breadth_first", "breadth_first_zb")  # accumulation groups apply


class ScheduleError(ValueError):
    """A schedule setting is illegal, or a generated schedule is invalid."""


class Op(str, Enum):  # noqa: UP042  (a StrEnum would print its value: str(Op.FORWARD) would be "F", not "Op.FORWARD")
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"  # zero bubble: a backward's input-gradient part (what the previous stage waits for)
    BACKWARD_WEIGHT = "W"  # ...and its weight-gradient part, after its I (deferred into idle time)
    UNSHARD = "UNSHARD"  # all-gather a stage's weights (FSDP), asynchronous: waited by the next compute
    RESHARD = "RESHARD"  # free the gathered weights (no communication)
    REDUCE_GRAD = "REDUCE_GRAD"  # gradient reduce-scatter over data parallel + 1/m scaling
    SEND_F = "SEND_F"  # send stage output of a micro-batch to the next stage's rank
    RECV_F = "RECV_F"  # post the receive of a stage's input activation
    SEND_B = "SEND_B"  # send input gradient of a micro-batch to the previous stage's rank
    RECV_B = "RECV_B"  # post the receive of a stage's output gradient


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
INPUT_GRAD_OPS = (Op.BACKWARD, Op.BACKWARD_INPUT)  # produce a micro-batch's input gradient (sent to the previous stage)
WEIGHT_GRAD_OPS = (Op.BACKWARD, Op.BACKWARD_WEIGHT)  # complete a micro-batch's weight gradients
FSDP_OPS = (Op.UNSHARD, Op.RESHARD, Op.REDUCE_GRAD)
P2P_OPS = (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B)


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: `op` on `stage` (global stage index) for `micro_batch` (None for FSDP ops)."""

    stage: int
    op: Op
    micro_batch: int | None = None

    def __str__(self) -> str:  # "3F1", "2UNSHARD" — the notation torch.distributed.pipelining uses
        mb = "" if self.micro_batch is None else str(self.micro_batch)
        return f"{self.stage}{self.op.value}{mb}"

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS


@dataclass(frozen=True)
class ScheduleSpec:
    """The knobs of a pipeline schedule (plain values, Hydra-friendly).

    Attributes:
        name: one of ``SCHEDULES``; "breadth_first_zb" is breadth-first with each backward split into its input-
            and weight-gradient parts, the weight parts deferred into idle time (zero bubble).
        pipeline_parallel: number of pipeline ranks (pp).
        loops: stages per pipeline rank; stage ``s`` lives on rank ``s % pp``.
        micro_batches: micro-batches per optimizer step (m), split from the per-replica batch.
        groups: breadth-first (and breadth_first_zb) only — run the m micro-batches as ``groups`` sequential
            breadth-first passes (accumulating gradients); divides activation memory, multiplies weight all-gathers.
        reshard_after_forward: FSDP policy — free gathered weights after a stage's forward pass and
            gather them again before its backward pass (less memory, twice the all-gathers).
        forward_only: evaluation/prediction: forward actions only, no gradient reduction.
    """

    name: str = "breadth_first"
    _: KW_ONLY  # every knob but the name by keyword: ScheduleSpec("gpipe", pipeline_parallel=2, micro_batches=4)
    pipeline_parallel: int = 1
    loops: int = 1
    micro_batches: int = 1
    groups: int = 1
    reshard_after_forward: bool = False
    forward_only: bool = False

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel * self.loops

    def stage_rank(self, stage: int) -> int:
        return stage % self.pipeline_parallel

    def local_stages(self, rank: int) -> list[int]:
        return list(range(rank, self.num_stages, self.pipeline_parallel))


@dataclass
class Schedule:
    """Per-rank ordered action lists for one step, plus the spec that produced them."""

    spec: ScheduleSpec
    actions: dict[int, list[Action]] = field(default_factory=dict)

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def fsdp_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.op in FSDP_OPS]

    def forwards_first(self) -> bool:
        """Whether every forward of a step ends before any backward starts, on any rank: the last stage runs all its
        micro-batches' forwards before its rank's first backward, and every stage runs its micro-batches in order
        (so the last stage's last forward follows every other forward). True for gpipe and breadth-first in one
        group (and its zero-bubble form); whole-step statistics (a router's load-balancing loss) need it."""
        last = self.spec.num_stages - 1
        for rank, actions in self.actions.items():
            compute = [a for a in actions if a.is_compute]
            for stage in self.spec.local_stages(rank):
                order = [a.micro_batch for a in compute if a.stage == stage and a.op == Op.FORWARD]
                if order != sorted(order):
                    return False
            if last in self.spec.local_stages(rank):
                ops = [a.op for a in compute]
                first_backward = next((i for i, op in enumerate(ops) if op != Op.FORWARD), len(ops))
                last_forward = max(i for i, a in enumerate(compute) if a.stage == last and a.op == Op.FORWARD)
                if last_forward > first_backward:
                    return False
        return True

    def format(self) -> str:
        """A compact text table: one line per rank."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in sorted(self.actions.items()))
