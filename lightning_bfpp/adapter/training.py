"""The training step of a pipelined module under Lightning's automatic optimization: the schedule runs forward and
backward inside ``training_step``; its gradients are made whole (tied copies summed, tensor-parallel layouts) and
parked until Lightning's ``backward``; the loss is shared to every rank, logged and checked for NaN; the step is
measured when asked (``measure_every_n_steps``).

The loss rule: a ``pipeline_loss`` returning ``(loss_sum, num_items)`` trains the mean over every counted item of the
global batch, as one process on that batch. torch's runtime divides the gradients by the micro-batches (m) and data
parallel averages them over the replicas and context-parallel ranks (dp x cp): each batch's gradients are handed over
times m x dp x cp (the gradient of
the batch's loss sums), and before the optimizer step (``before_optimizer_step``) divided by the items counted over
every batch since the last step (Lightning's ``accumulate_grad_batches``). A plain mean loss keeps torch's and
Lightning's averaging (over micro-batches, replicas and accumulated batches)."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch import LightningModule

from ..contract.hooks import defined_hook, training_batch
from ..dims import ParallelDims
from ..layout.tensor_parallel import grads_like_params
from ..runtime.measure import check_every_n_steps, measure_now, step_stats
from ..runtime.pipeline import PipelineRunner, batch_rows
from ..runtime.reduce import share_loss
from .handover import GradHandover
from .nonfinite import NonfiniteLoss


class TrainingStep:
    """What a training step keeps between Lightning's hooks: the parked gradients, the NaN policy, and the last
    measured step's numbers (``step_stats``, ``measured_step``)."""

    def __init__(self, measure_every_n_steps: int | None, nonfinite_loss: str, max_consecutive_skips: int) -> None:
        self.measure_every_n_steps = check_every_n_steps(measure_every_n_steps)
        self.nonfinite = NonfiniteLoss(nonfinite_loss, max_consecutive_skips)
        self.handover = GradHandover()  # gradients from the schedule in training_step, handed over in backward
        self.step_stats: dict[str, Any] = {}  # of the last measured step
        self.measured_step = False  # whether the last training step was measured
        self.counted = False  # whether the last batch's loss counted its items (a (loss_sum, num_items) loss)
        self.sum_scale = 1.0  # counted items: what makes the parked gradients those of the batch's loss sums
        self.window_items: float | None = None  # counted items: those of the batches handed over since the last step
        self._params: list[torch.nn.Parameter] | None = None  # the module's parameters, read once per run

    def forget_parameters(self) -> None:
        """At the start of a run (fit, validate, ...): the module's parameters are read again at its first step."""
        self._params = None

    def run(self, module: LightningModule, runner: PipelineRunner, batch: Any, batch_idx: int | None, *,
            dims: ParallelDims, device: torch.device, tied: Any, optimizers: list,
            step_context: Callable[[], AbstractContextManager], check_batch: Callable[[Any, bool], None],
            on_last_stage: Callable[[Callable[[], Any]], Any]) -> torch.Tensor:
        """One optimizer step's schedule on `batch`; returns the loss every rank logs. `check_batch(batch, measured)`
        compares the batch across a replica's ranks when due; `on_last_stage(fn)` runs the user's
        ``pipeline_train_metrics`` where the outputs are."""
        inputs, target = training_batch(module, batch)
        if self._params is None:  # walking the module tree costs more than the rest of a small step's bookkeeping
            self._params = list(module.parameters())
        params = [p for p in self._params if p.requires_grad]  # (a callback may freeze or unfreeze layers)
        train_metrics = defined_hook(module, "pipeline_train_metrics")
        self.measured_step = measure = measure_now(module.trainer, self.measure_every_n_steps)
        check_batch((inputs, target), measure)
        # Lightning zeroes grads between training_step and backward: park the fresh ones until backward.
        with self.handover.capture(params):
            with step_context():
                loss, outputs = runner.train_step(inputs, target, keep_outputs=callable(train_metrics), measure=measure)
            if tied:
                tied.sum_gradients()
            if dims.tensor_parallel > 1:
                grads_like_params(params)
        # from the last-stage ranks; float32, or float64 where the parameters are (precision="64-true")
        loss_dtype = torch.promote_types(torch.float32, params[0].dtype) if params else torch.float32
        loss, items = share_loss(loss, dims, device, loss_dtype)
        self.counted = items is not None
        self.sum_scale = float(runner.spec.micro_batches * dims.gradient_replicas)  # averaged over dp x cp
        if measure:
            self.step_stats = step_stats(runner, params, self.handover.grads(), optimizers, device)
        module.log("train_loss", loss, prog_bar=True, batch_size=batch_rows(inputs))
        if callable(train_metrics):
            with torch.no_grad():
                on_last_stage(lambda: train_metrics(outputs, target))
        step_logs = defined_hook(module, "pipeline_step_logs")
        if step_logs is not None:
            with torch.no_grad():
                on_last_stage(step_logs)
        # the shared loss: on a NaN/inf every rank takes this branch together, before the optimizer step
        if not self.nonfinite.keep(loss, module, batch_idx):
            self.handover.drop()  # backward hands nothing over; parameters without gradients are not stepped
        elif items is not None:
            self.window_items = (self.window_items or 0.0) + items
        return loss  # (even a skipped step's: Lightning refuses a None step output in distributed runs)

    def hand_over(self, accumulate_grad_batches: int) -> None:
        """In Lightning's ``backward``: the parked gradients, divided as Lightning divides an accumulated loss (a
        mean loss), or as the gradients of the batch's loss sums (counted items)."""
        self.handover.hand_over(self.sum_scale if self.counted else 1.0 / accumulate_grad_batches)

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After the last backward before an optimizer step (before clipping and ``on_before_optimizer_step``): with
        counted items, the gradients of the loss sums divided by the items counted since the last step."""
        if self.window_items is None:
            return
        scale, self.window_items = 1.0 / max(self.window_items, 1.0), None
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)
