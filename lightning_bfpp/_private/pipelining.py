"""The ONLY module touching torch.distributed.pipelining's private schedule runtime
(_PipelineScheduleRuntime, _Action). We feed it our own lowered action lists. Tested on torch 2.13 (the
import checks the range, versions.SUPPORTED). Public alternative checked: torch's schedule classes
(ScheduleLoopedBFS, ScheduleInterleaved1F1B, ...) have no breadth-first x groups order and their own FSDP prefetch."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _torch_schedules

from ..contract.layer_io import buffers_kept
from ..contract.step_totals import shape_inference
from ..schedule import COMPUTE_OPS, Op, Schedule
from . import torch_fast_paths  # noqa: F401  (torch's per-call Python work lightened: the runtime's host cost)
from .versions import check_version

check_version("torch")
# The stage method that runs the shape-inference forward: `_shape_inference` before torch 2.13 (reached only with
# versions.ALLOW_UNTESTED, e.g. a GPU image's torch 2.11).
_SHAPE_INFERENCE = next((name for name in ("_forward_metadata_inference", "_shape_inference")
                         if hasattr(PipelineStage, name)), None)
if not (
    hasattr(_torch_schedules, "_PipelineScheduleRuntime")
    and hasattr(getattr(_torch_schedules, "_ComputationType", None), "REDUCE_GRAD")
    and _SHAPE_INFERENCE
):
    raise ImportError(
        f"lightning-bfpp needs torch.distributed.pipelining's schedule runtime with UNSHARD/RESHARD/REDUCE_GRAD "
        f"actions (tested on torch 2.13); this is torch {torch.__version__}. Install torch>=2.13,<2.14."
    )


_TORCH_OP = {
    Op.FORWARD: _torch_schedules._ComputationType.FORWARD,
    Op.BACKWARD: _torch_schedules._ComputationType.FULL_BACKWARD,
    Op.BACKWARD_INPUT: _torch_schedules._ComputationType.BACKWARD_INPUT,  # stage_backward_input
    Op.BACKWARD_WEIGHT: _torch_schedules._ComputationType.BACKWARD_WEIGHT,  # stage_backward_weight
    Op.UNSHARD: _torch_schedules._ComputationType.UNSHARD,
    Op.RESHARD: _torch_schedules._ComputationType.RESHARD,
    Op.REDUCE_GRAD: _torch_schedules._ComputationType.REDUCE_GRAD,
    Op.SEND_F: _torch_schedules._ComputationType.SEND_F,
    Op.RECV_F: _torch_schedules._ComputationType.RECV_F,
    Op.SEND_B: _torch_schedules._ComputationType.SEND_B,
    Op.RECV_B: _torch_schedules._ComputationType.RECV_B,
}


def to_torch_actions(schedule: Schedule) -> dict[int, list[Any]]:
    return {
        rank: [_torch_schedules._Action(a.stage, _TORCH_OP[a.op], a.micro_batch) for a in actions]
        for rank, actions in schedule.actions.items()
    }


def build_runtime(
    schedule: Schedule,
    modules: dict[int, nn.Module],
    device: torch.device,
    group,
    loss_fn: Callable | None,
):
    """A torch pipeline runtime over fresh PipelineStages of `modules` that executes `schedule`."""
    spec = schedule.spec
    stages = [
        PipelineStage(mod, stage_index=s, num_stages=spec.num_stages, device=device, group=group)
        for s, mod in sorted(modules.items())
    ]
    for stage in stages:
        leave_no_trace_of_shape_inference(stage)
        no_step_totals_from_backward_shape_inference(stage)
        if _SHAPE_INFERENCE == "_shape_inference":
            no_p2p_warmup_to_itself(stage)
    runtime = _torch_schedules._PipelineScheduleRuntime(
        stages, n_microbatches=spec.micro_batches, loss_fn=loss_fn, scale_grads=True
    )
    # Our validated, lowered lists replace torch's own lowering (it has no breadth-first x groups order
    # and its FSDP prefetch policy is not ours). The stage->rank map is torch's default "loop" style.
    runtime.pipeline_order_with_comms = to_torch_actions(schedule)
    each_unit_waits_for_its_own(runtime, stages)
    return runtime, stages


def each_unit_waits_for_its_own(runtime: Any, stages: list[PipelineStage]) -> None:
    """On stages sharded per layer (``StageModule.per_layer_units``): torch's runtime waits for every FSDP unit's
    all-gather of a stage (``_assert_unsharded``, private) before the stage's first compute after its UNSHARD; here it
    waits for none, and each unit's own FSDP pre-forward (pre-backward) hook waits for its gather when the unit runs,
    so a stage's first layer computes while the next layers' weights still arrive. What a unit did not wait for is
    waited for after the compute. Public alternative checked: none (the wait is inside ``_step_microbatches``)."""
    per_layer = {stage.stage_index for stage in stages if getattr(stage.submod, "per_layer_units", False)}
    if not per_layer:
        return
    inner = runtime._assert_unsharded
    pending: dict[int, list[Any]] = {}

    def assert_unsharded(stage: PipelineStage) -> None:
        index = stage.stage_index
        if index in per_layer and index in runtime.unshard_ops:
            pending.setdefault(index, []).extend(runtime.unshard_ops.pop(index))
            runtime.unsharded_stages.add(index)
        inner(stage)

    runtime._assert_unsharded = assert_unsharded
    for stage in stages:
        if stage.stage_index not in per_layer:
            continue
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            compute = getattr(stage, name)

            def then_settle(*args, _compute=compute, _index=stage.stage_index, **kwargs):
                try:
                    return _compute(*args, **kwargs)
                finally:
                    for handle in pending.pop(_index, ()):
                        handle.wait()  # (a no-op for a unit whose hook waited)

            setattr(stage, name, then_settle)


def leave_no_trace_of_shape_inference(stage: PipelineStage) -> None:
    """torch infers a stage's output shapes by running its module once more before the first micro-batch (on
    the real first micro-batch on the first stage, on uninitialised tensors elsewhere), in the module's mode:
    that forward would update its buffers (BatchNorm running statistics, counters: with garbage on later
    stages) and draw random numbers (dropout). Wrap ``_forward_metadata_inference`` (private: the only place that
    forward runs) so buffers are restored and the random state is forked. Public alternative checked: static
    shapes (``PipelineStage(input_args=..., output_args=...)``) need every stage's output shapes known up front."""
    inner = getattr(stage, _SHAPE_INFERENCE)
    device = stage.device

    def isolated(*args, **kwargs):
        accelerators = [] if device.type == "cpu" else [device]
        with buffers_kept(stage.submod), torch.random.fork_rng(
                devices=accelerators, device_type=device.type if accelerators else "cuda"):
            return inner(*args, **kwargs)

    setattr(stage, _SHAPE_INFERENCE, isolated)


def no_step_totals_from_backward_shape_inference(stage: PipelineStage) -> None:
    """torch 2.13 infers the backward's shapes by calling the loss once more, on the shape-inference forward's
    output (``_backward_metadata_inference``, private: the only place that call happens): a loss that adds parts to
    the step's totals (``contract.step_totals``) must not count that call. Public alternative checked: static shapes
    (``PipelineStage(input_args=..., output_args=...)``) need every stage's output shapes known up front."""
    inner = getattr(stage, "_backward_metadata_inference", None)
    if inner is None:
        return

    def shapes_only(*args, **kwargs):
        with shape_inference():
            return inner(*args, **kwargs)

    stage._backward_metadata_inference = shapes_only


def no_p2p_warmup_to_itself(stage: PipelineStage) -> None:
    """Before torch 2.13 the runtime warmed p2p up with a message to each neighbouring stage, including a neighbour
    on the same rank (loops > 1 with pp=1), which gloo refuses. Same-rank stages pass activations in-process: drop
    those messages."""
    inner = stage._get_init_p2p_neighbors_ops
    stage._get_init_p2p_neighbors_ops = lambda: [op for op in inner() if op.group_peer != stage.group_rank]


def time_stage_compute(stage: PipelineStage, record: Callable[[str, int, Any, Any], None],
                       enabled: Callable[[], bool], clock: Callable[[], Any] = time.perf_counter) -> None:
    """Call ``record(kind, micro_batch, clock(), clock())`` ("F"/"B"/"I"/"W"; the clock before and after) around each
    forward, backward (or its input-gradient part) and weight-gradient part the runtime runs on `stage` while
    ``enabled()``. Why here: it wraps the PipelineStage methods the private runtime calls
    (``forward_one_chunk``/``backward_one_chunk``). Public alternatives checked: module forward hooks (miss the
    backward, which the runtime runs through autograd outside any module call) and profiler spans (need the
    profiler on)."""
    for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"), ("W", "backward_weight_one_chunk")):
        inner = getattr(stage, name)

        def timed(mb, *args, _inner=inner, _kind=kind, **kwargs):
            if not enabled():
                return _inner(mb, *args, **kwargs)
            t0 = clock()
            try:
                return _inner(mb, *args, **kwargs)
            finally:  # a backward without its weight gradients (full_backward=False) is zero bubble's input pass
                record("I" if _kind == "B" and kwargs.get("full_backward") is False else _kind, mb, t0, clock())

        setattr(stage, name, timed)


def after_reduce_grad(stage: PipelineStage, callback: Callable[[], None]) -> None:
    """Call `callback` right after the runtime ran `stage`'s REDUCE_GRAD action (``perform_reduce_grad``, which
    the private runtime calls after the stage's last backward). Public alternative checked: gradient hooks on the
    parameters (fire per parameter and per micro-batch, not once after the last one)."""
    inner = stage.perform_reduce_grad

    def reduce_after(*args, **kwargs):
        inner(*args, **kwargs)
        callback()

    stage.perform_reduce_grad = reduce_after


_OUR_OP = {torch_op: op for op, torch_op in _TORCH_OP.items()}


class RankActions(list):
    """One rank's action list for torch's runtime (``_step_microbatches`` iterates its rank's list once per step).

    - While ``enabled()``, it times each action: the runtime runs action i between taking it from the list and asking
      for action i + 1, so ``record(op, stage, micro_batch, start, end)`` gets every action's span (``op`` an `Op`; a
      compute action's span includes its wait for its input and its gathered weights). Public alternative checked:
      the ``record_function`` ranges torch's runtime puts around each action, which need the profiler on.
    - ``skip``: the positions of actions the next step leaves out, once (UNSHARDs issued before the step began,
      ``prefetch_first_gathers``)."""

    def __init__(self, actions: list[Any], record: Callable[..., None], enabled: Callable[[], bool],
                 clock: Callable[[], Any]) -> None:
        super().__init__(actions)
        self._record, self._enabled, self._clock = record, enabled, clock
        self.skip: frozenset[int] = frozenset()

    def __iter__(self):
        return self._steps() if self.skip or self._enabled() else super().__iter__()

    def _steps(self):
        skip, self.skip = self.skip, frozenset()
        timed = self._enabled()
        previous, start = None, None
        for i, action in enumerate(list.__iter__(self)):
            if i in skip:
                continue
            if timed:
                now = self._clock()
                if previous is not None:
                    self._record(*_named(previous), start, now)
                previous, start = action, now
            yield action
        if previous is not None:
            self._record(*_named(previous), start, self._clock())


def _named(action: Any) -> tuple[Op, int, int | None]:
    return _OUR_OP[action.computation_type], action.stage_index, action.microbatch_index


def time_actions(runtime: Any, record: Callable[..., None], enabled: Callable[[], bool],
                 clock: Callable[[], Any] = time.perf_counter) -> None:
    """Time every action `runtime` (from ``build_runtime``) runs on this rank (see `RankActions`)."""
    order = runtime.pipeline_order_with_comms
    order[runtime.rank] = RankActions(order[runtime.rank], record, enabled, clock)


def _fsdp_units(stage: PipelineStage) -> list[FSDPModule]:
    return [m for m in stage.submod.modules() if isinstance(m, FSDPModule)]


def prefetch_first_gathers(runtime: Any, stages: list[PipelineStage]) -> bool:
    """Issue now the all-gathers of the UNSHARD actions that open this rank's action list (before its first compute),
    as the runtime issues them (FSDP2 ``unshard(async_op=True)``), and hand their handles to `runtime`: its next step
    waits on them before its first compute on those stages and leaves those UNSHARDs out. Needs the list of
    `time_actions`. Returns whether a gather was issued (stages not sharded by FSDP have none). Public alternative
    checked: torch's runtime issues a step's gathers inside ``step`` only."""
    order = runtime.pipeline_order_with_comms[runtime.rank]
    by_index = {stage.stage_index: stage for stage in stages}
    issued = set()
    for i, action in enumerate(order):
        if _OUR_OP[action.computation_type] in COMPUTE_OPS:
            break
        if action.computation_type != _TORCH_OP[Op.UNSHARD]:
            continue  # a receive posted before the first compute
        units = _fsdp_units(by_index[action.stage_index])
        if units:
            runtime.unshard_ops[action.stage_index].extend(unit.unshard(async_op=True) for unit in units)
            issued.add(i)
    order.skip = frozenset(issued)
    return bool(issued)


def settle_prefetched(runtime: Any, stages: list[PipelineStage]) -> None:
    """Undo `prefetch_first_gathers` before anything but `runtime`'s next step uses those stages (an evaluation, a
    checkpoint, another runtime): wait for the gathers, free the gathered weights, and run the UNSHARDs again."""
    order = runtime.pipeline_order_with_comms[runtime.rank]
    by_index = {stage.stage_index: stage for stage in stages}
    for i in order.skip:
        stage = order[i].stage_index
        for handle in runtime.unshard_ops.pop(stage, []):
            handle.wait()
        for unit in _fsdp_units(by_index[stage]):
            unit.reshard()
    order.skip = frozenset()


def on_micro_batch(stage: PipelineStage, set_micro_batch: Callable[[int | None], None]) -> None:
    """Call ``set_micro_batch(mb)`` before and ``set_micro_batch(None)`` after each forward the runtime runs on
    `stage` (``forward_one_chunk``; torch's shape inference and evaluation calls in between see None). Public
    alternative checked: a module forward pre-hook does not see the micro-batch index."""
    inner = stage.forward_one_chunk

    def forward(mb, *args, **kwargs):
        set_micro_batch(mb)
        try:
            return inner(mb, *args, **kwargs)
        finally:
            set_micro_batch(None)

    stage.forward_one_chunk = forward
