"""The user's own LightningModule steps under bfpp. validation_step, test_step, predict_step (and the
optional training-metrics hook) run as written on the ranks that hold the last stage, where `self(x)` is
answered by the pipeline's output. What they log is recorded there and replayed on every rank of the
pipeline group in the same order, so every rank ends each step with the same keys and values and the
loggers' collectives (sync_dist, torchmetrics' sync) match on every rank."""
from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_mean

from .._private.lightning_api import metric_reductions, metric_step_value, set_metric_step_value
from . import step_state

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
# per Metric (attribute path) and list state: the dtype and trailing shape of what its updates append
ListStateKinds = dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]


@dataclass
class MetricRef:
    """A torchmetrics Metric logged by the user's step, named by its attribute in the LightningModule. The
    other pipeline ranks log their own (never updated) copy: its states are the reductions' identities
    (sum 0, empty cat, ±inf max/min), so torchmetrics' world-wide sync at compute() counts every sample
    once. Its step value (the last forward()'s result) travels with it."""

    attribute: str
    forward_cache: Any
    update_count: int


@dataclass
class StepRecord:
    """What the last stage's user step did: its `self.log` calls (in order), its return value and what it
    changed in the module's plain attributes."""

    calls: list[tuple[str, Any, dict[str, Any]]] = field(default_factory=list)
    result: Any = None
    state: list[step_state.StateChange] = field(default_factory=list)
    list_states: ListStateKinds = field(default_factory=dict)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        moved = copy.copy(value)  # keeps the dict's type (a defaultdict's factory)
        moved.update((k, _to(v, device)) for k, v in value.items())
        return moved
    return value


def _cpu(value: Any) -> Any:
    return _to(value, torch.device("cpu"))


def _same_inputs(args: tuple, expected: tuple) -> bool:
    if len(args) != len(expected):
        return False
    for a, e in zip(args, expected):
        if a is e:
            continue
        if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor) and a.shape == e.shape
                and torch.equal(a.to(e.device), e)):
            return False
    return True


@contextmanager
def pipeline_answers_forward(module: nn.Module, inputs: Any, output: Any, step: str) -> Iterator[None]:
    """Within the block, ``module(x)`` / ``module.forward(x)`` return `output` (the pipeline's output for
    `inputs`); any other input is refused, naming the rule."""
    expected = inputs if isinstance(inputs, tuple) else (inputs,)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and isinstance(args[0], tuple) and isinstance(inputs, tuple):  # self(x), x a tuple
            args = args[0]
        if kwargs or not _same_inputs(args, expected):
            raise ValueError(
                f"{type(module).__name__}.{step} called self(...) with inputs other than pipeline_inputs(batch)[0]: "
                "under strategy='bfpp', self(x) returns the pipeline's output for the batch's inputs only. Call "
                "self(x) with x = self.pipeline_inputs(batch)[0], and transform inputs inside pipeline_inputs() "
                "or the first layer."
            )
        return output

    module.forward = forward  # an instance attribute: shadows the class's forward for this call only
    try:
        yield
    finally:
        del module.forward


@contextmanager
def recording_logs(module: LightningModule) -> Iterator[list[tuple[str, Any, dict[str, Any]]]]:
    """Within the block, `module.log` (and `log_dict`, which calls it) records its calls instead of logging."""
    calls: list[tuple[str, Any, dict[str, Any]]] = []

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(module, name, value, *args, **kwargs).arguments
        calls.append((name, value, {k: v for k, v in bound.items() if k not in ("self", "name", "value")}))

    module.log = log
    try:
        yield calls
    finally:
        del module.log


def _pack(module: nn.Module, calls: list[tuple[str, Any, dict[str, Any]]]) -> list[tuple[str, Any, dict[str, Any]]]:
    """The calls as they cross the pipeline group: metrics by attribute name, tensors on the CPU."""
    names = {id(m): n for n, m in module.named_modules() if isinstance(m, Metric)}
    packed = []
    for name, value, kwargs in calls:
        if isinstance(value, Metric):
            attribute = kwargs.get("metric_attribute") or names.get(id(value))
            if attribute is None:
                raise ValueError(
                    f"self.log({name!r}, <{type(value).__name__}>): under strategy='bfpp' a logged torchmetrics Metric "
                    f"must be an attribute of {type(module).__name__} (e.g. self.val_acc = Accuracy(...) in __init__), "
                    "so every pipeline rank can log its own copy."
                )
            forward_cache, update_count = metric_step_value(value)
            value = MetricRef(attribute, _cpu(forward_cache), update_count)
        if kwargs.get("sync_dist_group") is not None:
            raise ValueError(
                f"self.log({name!r}, ..., sync_dist_group=...): under strategy='bfpp' sync_dist reduces over the "
                "data-parallel group (each pipeline rank of a replica logs the same value); drop sync_dist_group."
            )
        packed.append((name, _cpu(value), kwargs))
    return packed


_warned_mean_states: set[str] = set()


def _local_metric(module: nn.Module, ref: MetricRef, device: torch.device) -> Metric:
    metric = module.get_submodule(ref.attribute)
    set_metric_step_value(metric, _to(ref.forward_cache, device), ref.update_count)
    if ref.attribute not in _warned_mean_states and any(fx is dim_zero_mean
                                                        for fx in metric_reductions(metric).values()):
        _warned_mean_states.add(ref.attribute)
        rank_zero_warn(f"{ref.attribute}: a Metric with mean-reduced states is averaged over every rank at compute(), "
                       "including the pipeline ranks that hold no output; use sum-reduced states under "
                       "strategy='bfpp'.")
    return metric


def list_state_kinds(module: nn.Module) -> ListStateKinds:
    """Per Metric (by attribute path) and list state (AUROC's preds/target, CatMetric's value): the dtype and
    trailing shape of what the last stage's updates appended."""
    kinds = {}
    for path, metric in module.named_modules():
        if isinstance(metric, Metric):
            found = {}
            for state in metric_reductions(metric):
                items = getattr(metric, state)
                if isinstance(items, list) and items and isinstance(items[-1], torch.Tensor):
                    found[state] = (items[-1].dtype, tuple(items[-1].shape[1:]))
            if found:
                kinds[path] = found
    return kinds


def give_empty_list_states(module: nn.Module, kinds: ListStateKinds,
                           device: torch.device) -> None:
    """On a rank whose copies were never updated: an empty list state holds one tensor of no rows with the last
    stage's dtype and trailing shape, so torchmetrics' sync gathers matching tensors (it would send a float 1-d
    ``tensor([])`` against the last stage's 2-d or int64 state: gloo aborts)."""
    for path, states in kinds.items():
        metric = module.get_submodule(path)
        for state, (dtype, trailing) in states.items():
            items = getattr(metric, state)
            if isinstance(items, list) and not items:
                items.append(torch.empty((0, *trailing), dtype=dtype, device=device))


def replay(module: LightningModule, calls: list[tuple[str, Any, dict[str, Any]]], last_stage: bool,
           dp_group: dist.ProcessGroup | None, device: torch.device) -> list[str]:
    """Log `calls` on this rank; return the names of non-finite plain values. sync_dist reduces over the
    data-parallel group only (every pipeline rank of a replica holds the same value), which gives the
    one-process result for every reduce_fx."""
    nonfinite = []
    for name, value, kwargs in calls:
        if isinstance(value, MetricRef):
            value = module.get_submodule(value.attribute) if last_stage else _local_metric(module, value, device)
        else:
            value = _to(value, device)
            if not bool(torch.isfinite(torch.as_tensor(value)).all()):
                nonfinite.append(name)
        if dp_group is not None and kwargs.get("sync_dist"):
            kwargs = {**kwargs, "sync_dist_group": dp_group}
        module.log(name, value, **kwargs)
    return nonfinite


def run_on_last_stage(
    module: LightningModule,
    method: Callable[..., Any] | None,
    holds_last_stage: bool,
    pp_group: dist.ProcessGroup | None,
    last_rank: int,
    dp_group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[Any, list[str]]:
    """Run `method` (a user step, with forward answered and logs recorded) where the last stage is, share what
    it logged, returned and changed in the module's plain attributes (``step_state``) over the pipeline group
    (`last_rank`: its group rank), replay the logs and the changes on every rank, and return the step's result
    on every rank, with the names of the non-finite values it logged."""
    record, result = StepRecord(), None
    crossing = pp_group is not None and dist.get_world_size(pp_group) > 1  # other pipeline ranks wait for it
    if holds_last_stage and method is not None:
        before = step_state.snapshot(module) if crossing else {}
        with recording_logs(module) as calls:
            result = method()
        record = StepRecord(_pack(module, calls), result)
        if crossing:
            record.state, record.list_states = step_state.changes(module, before), list_state_kinds(module)
    if crossing:  # the result crosses on the CPU, only here
        state = [step_state.StateChange(c.attribute, c.kind, _cpu(c.value)) for c in record.state]
        box = [StepRecord(record.calls, _cpu(record.result), state, record.list_states)]
        dist.broadcast_object_list(box, group=pp_group, group_src=last_rank)
        record = box[0]
        if not holds_last_stage:
            result = _to(record.result, device)
            step_state.apply(module, [step_state.StateChange(c.attribute, c.kind, _to(c.value, device))
                                      for c in record.state])
            give_empty_list_states(module, record.list_states, device)
    nonfinite = replay(module, record.calls, holds_last_stage, dp_group, device)
    return result, nonfinite


def user_step(module: LightningModule, runner: Any, step: str, args: tuple, kwargs: dict,
              run: Callable[[Callable[[], Any]], tuple[Any, list[str]]]) -> Any:
    """The user's own `step` (validation_step, test_step, predict_step) with `self(x)` answered by the pipeline's
    forward of this batch (`runner`); a predict_step the user did not write returns that output. `run` runs a
    function on the last stage and replays its logs everywhere (``run_on_last_stage`` with the job's groups)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    batch = kwargs.get("batch", args[0] if args else None)
    inputs = module.pipeline_inputs(batch)[0]
    output = runner.predict_step(inputs)  # every rank takes part; the output is on the last stage's ranks
    if not is_overridden(step, module):
        method = lambda: output  # noqa: E731  (Lightning's default predict_step is self(batch))
    else:
        def method():
            with pipeline_answers_forward(module, inputs, output, step):
                return getattr(module, step)(*args, **kwargs)
    result, nonfinite = run(method)
    if nonfinite:
        rank_zero_warn(f"{type(module).__name__}.{step} logged non-finite {', '.join(nonfinite)} "
                       f"(batch {kwargs.get('batch_idx', args[1] if len(args) > 1 else '?')}).")
    return result
