"""Run one rank's part of a schedule on its local stage modules: training step (forward +
backward of all micro-batches), forward-only evaluation, prediction. Device-agnostic."""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._private.pipelining import build_runtime, prefetch_first_gathers, settle_prefetched
from ..contract.context_parallel import sharding
from ..contract.hooks import loss_parts
from ..contract.layer_io import BOUNDARY_RULE
from ..contract.step_totals import StepTotals, step_totals
from ..dims import CP, PP, Names, ParallelDims, micro_batch_size
from ..layout.mesh import gradient_mesh, parameter_mesh
from ..layout.stage_inputs import input_kwargs
from ..layout.tensor_parallel import check_sequence_length
from ..schedule import Schedule, build_schedule
from .cuda_graphs import attach as attach_graphs
from .cuda_graphs import capture_stages
from .grad_sync import BucketedAllReduce
from .instrument import CompileCounter, SavedActivationMeter, Timeline, local_bytes
from .sequence_shards import ContextParallel

_BATCH_NAMES = Names(replica_batch="batch")  # how a step's batch is named when it does not split into micro-batches


def _shape_key(inputs: Any) -> tuple:
    items = inputs if isinstance(inputs, tuple) else (inputs,)
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in items)


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return type(value)(_detach(v) for v in value) if isinstance(value, (tuple, list)) else value


IGNORED = -100  # the target value PyTorch's and Hugging Face's losses ignore
MEAN_WITH_IGNORED = (
    "bfpp: pipeline_loss returned a mean and its targets hold ignored values (-100): each micro-batch's mean is "
    "averaged, so a target in a micro-batch with few counted targets weighs more than in one process. Return "
    "(loss_sum, num_items) from pipeline_loss (e.g. F.cross_entropy(..., reduction='sum'), (target != -100).sum()) "
    "to train the mean over the global batch's counted targets (docs/adapting.md, the loss).")


class StepLoss(NamedTuple):
    """A training step's loss on a rank holding the last stage: the micro-batches' mean loss (`items` None), or, for
    a ``pipeline_loss`` that returns ``(loss_sum, num_items)``, the sum of the losses and of the counted items."""

    value: torch.Tensor
    items: torch.Tensor | None


class CountedLoss:
    """The user's ``pipeline_loss`` as torch's runtime calls it: of a ``(loss_sum, num_items)`` pair it returns the sum
    (what backward differentiates) and records the count by the returned tensor (`items`: torch's runtime also calls
    the loss once to infer the backward's shapes, a call whose tensor is not among the step's losses); a plain loss
    passes through."""

    def __init__(self, loss_fn: Callable[[Any, Any], Any]) -> None:
        self.loss_fn = loss_fn
        self.items: dict[int, torch.Tensor] = {}  # id(returned loss) -> its counted items
        self.checked = False  # the first micro-batch of a mean loss is looked at for ignored targets, once

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        loss, items = loss_parts(self.loss_fn(output, target))
        if items is not None:
            self.items[id(loss)] = torch.as_tensor(items, device=loss.device).detach().reshape(())
        elif not self.checked:
            self.checked = True
            if isinstance(target, torch.Tensor) and not target.is_floating_point() and bool((target == IGNORED).any()):
                warnings.warn(MEAN_WITH_IGNORED, stacklevel=2)
        return loss


def batch_rows(inputs: Any) -> int:
    """Samples in a batch of pipeline inputs (the first tensor's rows)."""
    first = inputs[0] if isinstance(inputs, tuple) else inputs
    return first.shape[0]


class PipelineRunner:
    """Executes validated schedules for the local stages of one pipeline rank.

    One torch runtime (with its own PipelineStages and p2p buffers) is kept per mode and input shape,
    since shapes are inferred once per runtime.
    """

    def __init__(
        self,
        schedule: Schedule,
        modules: dict[int, nn.Module],
        device: torch.device,
        pp_group: dist.ProcessGroup | None,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        replicate_group: dist.ProcessGroup | None = None,
        compiled: bool = False,
        dims: ParallelDims | None = None,
        dp_group: dist.ProcessGroup | None = None,
        context: ContextParallel | None = None,
        cuda_graphs: bool = False,
        router_loss: str = "batch",
    ):
        self.spec = spec = schedule.spec
        self.modules = modules
        self.device = device
        self.pp_group = pp_group
        self.loss_fn = CountedLoss(loss_fn)
        self.replicate_group = replicate_group  # data-parallel group when grads are all-reduced, not sharded
        # replicated stages: each stage's gradients all-reduced (bucketed, async) from its REDUCE_GRAD action on
        self.grad_sync = BucketedAllReduce(replicate_group) if replicate_group is not None else None
        self.schedules: dict[str, Schedule] = {"train": schedule}
        self.schedules["forward"] = build_schedule(dataclasses.replace(spec, forward_only=True))
        self._runtimes: dict[tuple, tuple[Any, list]] = {}
        self.timeline = Timeline(device)
        self.meter = SavedActivationMeter(modules.values())
        self.last_stats: dict[str, float] = {}
        self.compiled = CompileCounter() if compiled else None  # layers compiled: graphs made per training step
        self.dims = dims  # the layout: its sequence rule is checked on every batch (None: no rule)
        self.dp_group = dp_group  # the replicas of this rank's stages: a loss's step totals are summed over it
        self.context = context  # context parallel: this rank's share of every sequence (None: whole sequences)
        # a loss reading whole-step totals in backward needs every forward first (contract.step_totals); a router
        # loss per micro-batch reads none (contract.router_loss)
        self.router_loss = router_loss
        self._not_forwards_first = None if schedule.forwards_first() else (
            f"bfpp: pipeline_loss reads totals of the whole step in backward (a router's load-balancing loss over the "
            f"batch), and schedule={spec.name} (groups={spec.groups}) starts a backward before the step's last "
            "forward: use router_loss='micro_batch' (each micro-batch's own), or schedule=breadth_first (groups=1) "
            "or gpipe.")
        self.message_bytes = 0  # the largest activation message this rank sends (a stage's output, but the last's)
        # every stage gets the micro-batch's inputs when a stage computes side inputs (pipeline_side_inputs)
        self._side_inputs = any(getattr(m, "_side_inputs", None) for m in modules.values())
        self._last_train: tuple[Any, list] | None = None  # the runtime (and its stages) of the last training step
        self._prefetched: tuple[Any, list] | None = None  # a runtime whose next step's first gathers are out
        self.prefetches = 0  # steps whose first gathers started before them (cross-step overlap)
        self.graphs = capture_stages(modules) if cuda_graphs else None  # CUDA graphs of the training passes

    @classmethod
    def on_mesh(cls, schedule: Schedule, modules: dict[int, nn.Module], *, device: torch.device, mesh: DeviceMesh,
                loss_fn: Callable[[Any, Any], torch.Tensor], dims: ParallelDims,
                compiled: bool = False, cuda_graphs: bool = False,
                say: Callable[[str], Any] = print, router_loss: str = "batch") -> PipelineRunner:
        """A runner over the `mesh` of the layout `dims`: p2p over its pipeline group; gradients all-reduced over its
        data-parallel (x context-parallel) group unless the stages are sharded (FSDP2 reduce-scatters them); under
        context parallel each step runs on this rank's share of every sequence (`say` names attention's path).
        `router_loss`: the router loss's definition in a step ("batch" or "micro_batch"; ``contract.router_loss``)."""
        grads = gradient_mesh(parameter_mesh(dims, mesh))  # dp, or dp x cp
        replicate_group = grads.get_group() if not dims.sharded and grads.size() > 1 else None
        dp_group = grads.get_group() if grads.size() > 1 else None
        context = ContextParallel(mesh, device) if CP in (mesh.mesh_dim_names or ()) else None
        if context is not None:
            say(f"bfpp: context_parallel={dims.context_parallel}: attention by {context.attention}")
        return cls(schedule, modules, device, mesh[PP].get_group(), loss_fn, replicate_group=replicate_group,
                   compiled=compiled, dims=dims, dp_group=dp_group, context=context, cuda_graphs=cuda_graphs,
                   router_loss=router_loss)

    def _new_totals(self) -> StepTotals:
        """The totals of a training step: summed over the replicas, guarded, with the step's router-loss definition."""
        return StepTotals(self._sum_over_replicas, self._not_forwards_first, self.router_loss)

    def _sum_over_replicas(self, t: torch.Tensor) -> None:
        if self.dp_group is not None:
            dist.all_reduce(t, group=self.dp_group)

    def _count_message(self, _module: nn.Module, _args: Any, output: Any) -> None:
        tensors = output if isinstance(output, (tuple, list)) else (output,)
        self.message_bytes = max(self.message_bytes, local_bytes(t for t in tensors if isinstance(t, torch.Tensor)))

    @property
    def has_last_stage(self) -> bool:
        return self.spec.num_stages - 1 in self.modules

    def _forward_schedule(self, batch: int) -> Schedule:
        """The forward-only schedule for a batch of `batch` samples. A batch that does not split into
        `micro_batches` (an evaluation loader's ragged last batch) runs as gcd(batch, micro_batches) equal
        micro-batches in breadth-first order (legal for every micro-batch count; forward-only, any order gives
        the same outputs), so no sample is dropped."""
        m = math.gcd(batch, self.spec.micro_batches)
        if m == self.spec.micro_batches:
            return self.schedules["forward"]
        key = f"forward/{m}"
        if key not in self.schedules:
            self.schedules[key] = build_schedule(dataclasses.replace(
                self.spec, name="breadth_first", micro_batches=m, groups=1, forward_only=True))
        return self.schedules[key]

    def _runtime(self, mode: str, inputs: Any):
        key = (mode, _shape_key(inputs))
        if key not in self._runtimes:
            schedule = self.schedules["train"] if mode == "train" else self._forward_schedule(batch_rows(inputs))
            loss_fn = None if mode == "predict" else self.loss_fn
            runtime, stages = build_runtime(schedule, self.modules, self.device, self.pp_group, loss_fn)
            self.timeline.attach_runtime(runtime)
            for stage in stages:
                self.timeline.attach(stage)
                if self.grad_sync is not None and mode == "train":
                    self.grad_sync.attach(stage)
                if self.graphs is not None and mode == "train":
                    attach_graphs(self.graphs, stage)
            self._runtimes[key] = (runtime, stages)
        return self._runtimes[key][0]

    def _run(self, mode: str, inputs: Any, target: Any, keep_outputs: bool = False) -> tuple[Any, list[torch.Tensor]]:
        if self.dims is not None and self.dims.sequence_divisor > 1:
            check_sequence_length(inputs, self.dims)
        if mode == "train":
            micro_batch_size(batch_rows(inputs), self.spec.micro_batches, _BATCH_NAMES)
        shard = None
        if self.context is not None:  # this rank's share of every sequence, and of the targets
            inputs, target = self.context.split(inputs, "the inputs"), self.context.split(target, "the target")
            shard = self.context.shard
        runtime = self._runtime(mode, inputs)
        if self._prefetched is not None and self._prefetched[0] is not runtime:
            self.settle()  # the gathers were for another runtime's step (an evaluation, another batch shape)
        self._prefetched = None
        if mode == "train":
            self._last_train = self._runtimes[(mode, _shape_key(inputs))]
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        losses: list[torch.Tensor] = []
        self.loss_fn.items.clear()
        self.timeline.clear()
        start = self.timeline.clock() if self.timeline.enabled else None  # (a CUDA event: no sync unmeasured)
        side = input_kwargs(inputs) if self._side_inputs else {}
        try:
            if mode == "train":
                batch = [t for t in (*args, target) if isinstance(t, torch.Tensor)]
                with self._measured(batch) if self.timeline.enabled else nullcontext(), \
                        step_totals(self._new_totals()), sharding(shard):
                    out = runtime.step(*args, target=target, losses=losses, return_outputs=keep_outputs, **side)
            else:
                with sharding(shard):
                    out = runtime.step(*args, **side)
        except Exception as error:
            if type(error).__name__ == "PipeliningMetadataError":  # torch's check of what crosses stages
                error.add_note(f"bfpp: the first stage's arguments are pipeline_inputs(batch)[0]; {BOUNDARY_RULE}.")
            raise
        self.last_stats = self.timeline.stats(start, self.timeline.clock()) if start is not None else {}
        if self.context is not None and (mode != "train" or keep_outputs):
            out = self.context.whole(out)  # whole sequences for the user's step and metrics
        return out, losses

    def prefetch_next_step(self) -> None:
        """Cross-step overlap, right after the optimizer step: the next training step's first all-gathers (the
        UNSHARDs before this rank's first compute) start now, overlapping what runs between the steps (the rest of
        the optimizer hooks, callbacks, logging, the next batch's loading); the gathered weights are held across the
        step boundary. Anything but that step settles them first (``settle``)."""
        if self._last_train is not None and prefetch_first_gathers(*self._last_train):
            self._prefetched = self._last_train
            self.prefetches += 1

    def settle(self) -> None:
        """Wait for and free prefetched gathers (before an evaluation, a checkpoint, the end of a run)."""
        if self._prefetched is not None:
            settle_prefetched(*self._prefetched)
            self._prefetched = None

    @contextmanager
    def _measured(self, batch: list[torch.Tensor]) -> Iterator[None]:
        """A measured training step: saved activations counted, and the activation messages (outputs of every stage
        but the last) sized. Unmeasured steps pay for neither (a forward hook alone puts a module's calls on
        torch's slower path)."""
        hooks = [module.register_forward_hook(self._count_message) for s, module in self.modules.items()
                 if s != self.spec.num_stages - 1]
        try:
            with self.meter.track(exclude=batch):
                yield
        finally:
            for hook in hooks:
                hook.remove()

    def train_step(self, inputs: Any, target: Any, keep_outputs: bool = False,
                   measure: bool = True) -> tuple[StepLoss | None, Any]:
        """Forward and backward of all micro-batches; leaves reduced, 1/m-scaled grads in `.grad`.

        Returns the step's loss on the rank holding the last stage (else None; see `StepLoss`) and, with
        `keep_outputs`, the last stage's outputs of all micro-batches concatenated (detached; else None).
        `measure`: record this step's compute timeline (`last_stats`) and saved-activation peak (`meter.peak`);
        off, neither the timing wrappers nor the saved-tensor hook do any work.
        """
        self.timeline.enabled = measure
        self.meter.peak = self.meter.current
        with self.compiled.step() if self.compiled is not None else nullcontext():
            out, losses = self._run("train", inputs, target, keep_outputs)
        if self.grad_sync is not None:
            self.grad_sync.wait()
        loss = None
        if losses:
            values = torch.stack([value.detach() for value in losses])
            items = [self.loss_fn.items[id(value)] for value in losses if id(value) in self.loss_fn.items]
            # float64: a sum of sums (large where many items count) keeps the precision of its parts
            loss = StepLoss(values.double().sum(), torch.stack(items).sum()) if items else StepLoss(values.mean(), None)
        self.loss_fn.items.clear()
        return loss, _detach(out) if keep_outputs else None

    def predict_step(self, inputs: Any) -> Any:
        """The last stage's output for `inputs` (micro-batches concatenated) on the rank holding it, else None."""
        with torch.no_grad():
            out, _ = self._run("predict", inputs, None)
        return out
