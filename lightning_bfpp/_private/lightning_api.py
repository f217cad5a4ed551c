"""The private Lightning (and torchmetrics) APIs lightning-bfpp uses. Each entry says why it is needed and which
public alternative was checked (Lightning 2.6.6, torchmetrics 1.9). Importing this module checks the installed
versions against the tested ranges (versions.SUPPORTED). Also private, and not wrappable here: the strategy
overrides Lightning's ``Strategy._configure_launcher`` hook (the only place a strategy chooses its launcher)."""
from __future__ import annotations

import functools
import importlib
import inspect
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _num_cpus_available,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
from lightning.pytorch.utilities import signature_utils
from torchmetrics import Metric

from .versions import check_version

check_version("lightning")
check_version("torchmetrics")

# Lightning's popen launcher (this process is rank 0 and starts ranks 1.. as copies of the command line), which
# launcher.CheckingLauncher subclasses and ModelParallelStrategy installs. Public alternative checked: none;
# Lightning exports no launcher class (lightning.pytorch.strategies.launchers has only private names).
SubprocessScriptLauncher = _SubprocessScriptLauncher

# torch.set_num_threads(cpu count / local processes) unless OMP_NUM_THREADS is set, as Lightning's launcher does
# before running the function. Public alternative checked: torch.set_num_threads (would drop Lightning's rule).
set_num_threads_if_needed = _set_num_threads_if_needed
# The cores that rule divides (this process's CPU affinity, else os.cpu_count()). Public alternative checked:
# os.sched_getaffinity / os.cpu_count (would repeat Lightning's choice between them).
num_cpus_available = _num_cpus_available

# Lightning's strategies' all_gather (stacked, optional gradient sync) and reduce ("mean"/"sum"/ReduceOp, gloo's
# missing AVG, a barrier first) over a process group, for bfpp's collectives over the replicas
# (lightning_bfpp/adapter/collectives.py) to behave as ModelParallelStrategy's own. Public alternative checked:
# torch.distributed.all_gather / all_reduce (would drop those rules: the same calls, reimplemented).
all_gather_if_distributed = _all_gather_ddp_if_available
sync_if_distributed = _sync_ddp_if_available

# Moves optimizer state tensors to the device after a checkpoint restore, as Lightning's strategies do. Public
# alternative checked: none in Lightning or torch (Optimizer.load_state_dict casts to the params' device only).
optimizers_to_device = _optimizers_to_device


def process_group_timeout(strategy: ModelParallelStrategy) -> timedelta | None:
    """The `timeout` given to ModelParallelStrategy (``_timeout``; it applies it to the default process group only).
    Public alternative checked: none; the strategy does not expose it."""
    return strategy._timeout


@contextmanager
def process_group_timeout_at_least(strategy: ModelParallelStrategy, least: timedelta) -> Iterator[timedelta | None]:
    """Within the block the strategy's ``_timeout`` is at least `least` (ModelParallelStrategy's
    ``_setup_distributed`` gives it to init_process_group, whose rendezvous waits for every process to start);
    yields the requested timeout. Public alternative checked: none; Lightning passes ``_timeout`` itself."""
    requested = strategy._timeout
    if requested is not None:
        strategy._timeout = max(requested, least)
    try:
        yield requested
    finally:
        strategy._timeout = requested


# torchmetrics Metric state that lightning_bfpp/adapter/steps.py carries across the pipeline group, so a metric the user
# logs on the last stage is logged with the same step value by every pipeline rank. Public alternatives checked:
# ``forward()`` (would update the states on ranks without outputs: counted twice at compute()), ``metric_state`` (the
# reduced states, not the step value) and ``reset()`` (also clears the states).

def metric_step_value(metric: Metric) -> tuple[Any, int]:
    """The value `metric`'s last forward() returned (``_forward_cache``) and its ``_update_count``."""
    return metric._forward_cache, metric._update_count


def set_metric_step_value(metric: Metric, forward_cache: Any, update_count: int) -> None:
    """Make `metric` (never updated on this rank) log `forward_cache` as its step value; compute() runs anew."""
    metric._forward_cache = forward_cache
    metric._update_count = max(metric._update_count, update_count)  # compute() without update would warn
    metric._computed = None


def metric_reductions(metric: Metric) -> dict[str, Any]:
    """Each state's reduction function (``_reductions``; to warn about mean-reduced states)."""
    return metric._reductions


def model_summary_settings(callback: Any) -> tuple[int, dict[str, Any]]:
    """A ModelSummary callback's ``max_depth`` and extra ``summarize`` arguments (``_max_depth``,
    ``_summarize_kwargs``), to build bfpp's summary with the user's settings. Public alternative checked: none."""
    return callback._max_depth, dict(callback._summarize_kwargs)


# The logger of Lightning's checkpoint connector (lightning/pytorch/trainer/connectors/checkpoint_connector.py), which
# logs a line about `weights_only` on every save that does not name it. Public alternative checked: none.
CHECKPOINT_CONNECTOR_LOGGER = "lightning.pytorch.trainer.connectors.checkpoint_connector"


def check_precision_first(strategy_class: type, check: Callable[[str], None]) -> None:
    """``Trainer(strategy=<a strategy_class>, precision=...)`` runs `check(precision)` before Lightning's own
    precision check (``_AcceleratorConnector._validate_precision_choice``), which answers "16-mixed" under any
    ModelParallelStrategy with a list holding "16-true" (refused by bfpp too), and refuses "64-true", which bfpp runs
    (Lightning's DoublePrecision plugin: float64 parameters and inputs). Every other strategy gets Lightning's
    check alone. Public alternative checked: none; the Trainer checks the precision before any strategy hook runs
    (the strategy object is known by then: ``_init_strategy`` comes first)."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    lightning_check = _AcceleratorConnector._validate_precision_choice
    if getattr(lightning_check, "checks_first", None) is strategy_class:
        return

    def validate_precision_choice(connector: Any) -> None:
        if isinstance(getattr(connector, "strategy", None), strategy_class):
            check(str(connector._precision_flag))
            if str(connector._precision_flag) == "64-true":  # Lightning's other checks are of fp16 and bitsandbytes
                return
        lightning_check(connector)

    validate_precision_choice.checks_first = strategy_class  # type: ignore[attr-defined]
    _AcceleratorConnector._validate_precision_choice = validate_precision_choice


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a LightningOptimizer (its public ``.optimizer`` property), else `optimizer`."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def set_module_device_mesh(module: Any, mesh: Any) -> None:
    """Give the LightningModule its ``device_mesh`` (a read-only property over ``_device_mesh``), as Lightning's
    ModelParallelStrategy does in its ``setup_environment``. Public alternative checked: none (no setter)."""
    module._device_mesh = mesh


def train_data_source(trainer: Any) -> Any:
    """The training data `fit()` was given (``fit_loop._data_source``, set before the strategy's setup: its
    ``instance`` is the DataLoader or datamodule, ``dataloader()`` builds the loader), else None. Public
    alternative checked: ``trainer.train_dataloader`` (None until the fit loop sets up its data, after setup)."""
    return getattr(getattr(trainer, "fit_loop", None), "_data_source", None)


def skip_logged_value_moves_in_place() -> None:
    """Make Lightning's ``_ResultMetric.to`` return at once when all its tensors already are on the device asked for.

    ``LightningModule.log`` calls ``_ResultMetric.to(value.device)`` on every call, and its ``to`` rebuilds the
    metric's whole ``__dict__`` through ``apply_to_collection`` (module dicts, its metadata dataclasses): ~150 us per
    logged value on this CPU, whether or not anything moves — about a tenth of a small step's host time for bfpp's one
    ``train_loss`` per step (benchmarks/host_overhead.py). With every tensor in place that walk changes nothing, so
    returning early is the same result; any other call (another device, a dtype, a torchmetrics value) goes to
    Lightning's own ``to``. Applies to every Lightning run in the process (speed only). Public alternative checked:
    none; ``self.log`` always calls it, and bfpp's loss must stay a ``self.log`` value (callbacks, loggers, the
    progress bar read it there). Idempotent; Lightning's own stays reachable as ``_ResultMetric.to.__wrapped__``."""
    if getattr(_ResultMetric.to, "_bfpp_in_place", False):
        return
    move = _ResultMetric.to

    @functools.wraps(move)
    def to(self: _ResultMetric, *args: Any, **kwargs: Any) -> _ResultMetric:
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.device) and _all_on(self, args[0]):
            return self
        return move(self, *args, **kwargs)

    to._bfpp_in_place = True  # type: ignore[attr-defined]
    _ResultMetric.to = to  # type: ignore[method-assign]


def _all_on(metric: _ResultMetric, device: torch.device) -> bool:
    """Whether every tensor `metric.to` would move (its value, batch-size count, defaults, last step value) already
    is on `device`; False for anything else in its ``__dict__`` that ``to`` would walk into (another tensor, a
    torchmetrics value, a container that is not empty: a sync cache)."""
    tensors = [metric.__dict__.get(name) for name in ("value", "cumulated_batch_size", "_forward_cache")]
    tensors += list(metric.__dict__.get("_defaults", {}).values())
    for name, value in metric.__dict__.items():
        if name in _CHECKED:
            continue
        # (a Metric is an nn.Module: checked as one, much faster than Metric's ABC isinstance)
        if isinstance(value, (torch.Tensor, torch.nn.Module)) or (value and isinstance(value, _CONTAINERS)):
            return False
    return all(t is None or (isinstance(t, torch.Tensor) and t.device == device) for t in tensors)


_CONTAINERS = (dict, list, tuple, set)
# what `_all_on` reads itself, and the states' flags and reduction functions (never tensors)
_CHECKED = frozenset({"value", "cumulated_batch_size", "_forward_cache", "_defaults", "_persistent", "_reductions"})


# Lightning's per-hook bookkeeping: every hook call of a training step (~22 at one micro-batch: the module's, the
# callbacks', the strategy's) opens a profiler range, and two calls a step read a hook's signature. At bfpp's host cost
# per step (benchmarks/host_overhead.py) each is worth removing, and each bridge below does exactly what Lightning's
# own path does, only with less work:
#   pass_through_profiles_without_generators_in_place   a @contextmanager generator per range, ~58 per step
#   hook_signatures_read_once_in_place        inspect.getfullargspec of training_step, twice per step
# Public alternative checked for each: none (they are inside Lightning's loop; a strategy hook cannot reach them).
# Installed by the strategy's setup for fitting, like ``skip_logged_value_moves_in_place``: process-wide (speed only),
# idempotent, Lightning's own functions kept as each replacement's ``__wrapped__`` (``restore_per_hook_bookkeeping``
# puts them back); ``tests/test_private_apis.py`` compares each with Lightning's own.

def pass_through_profiles_without_generators_in_place() -> None:
    """Make ``PassThroughProfiler.profile`` (the Trainer's profiler unless one is given) return
    ``contextlib.nullcontext(action_name)`` (entering gives the name, nothing else happens) instead of running
    Lightning's ``Profiler.profile`` generator (``@contextmanager``: start, yield the name, stop), whose start and
    stop do nothing for this class: ~1 us instead of ~6 us a range on this CPU, ~58 ranges a step. Only for
    PassThroughProfiler itself (a subclass gets Lightning's own, its start and stop called) and only while its start
    and stop are Lightning's (bodies of ``pass``: checked at install). Idempotent."""
    current = PassThroughProfiler.profile
    if getattr(current, "_bfpp_passing", False):
        return
    if not all(_does_nothing(getattr(PassThroughProfiler, name)) for name in ("start", "stop")):
        return

    @functools.wraps(current)
    def profile(self: Any, action_name: str) -> Any:
        if type(self) is PassThroughProfiler:
            return nullcontext(action_name)
        return current(self, action_name)

    profile._bfpp_passing = True  # type: ignore[attr-defined]
    profile._bfpp_had_own = "profile" in PassThroughProfiler.__dict__  # type: ignore[attr-defined]
    PassThroughProfiler.profile = profile  # type: ignore[method-assign]


def _does_nothing(fn: Callable) -> bool:
    """Whether `fn` is a function whose body is ``pass`` (its code: return None, nothing else)."""
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_code == (lambda self, action_name: None).__code__.co_code


# What a function's signature may be read from besides its code (Lightning follows __wrapped__; Python 3.11's
# getfullargspec reads __signature__ and _partialmethod, later versions __partialmethod__)
_SIGNATURE_ATTRIBUTES = frozenset({"__wrapped__", "__signature__", "_partialmethod", "__partialmethod__"})
# The Lightning modules that import ``is_param_in_hook_signature`` by name (every one of them in 2.6.6).
_SIGNATURE_READERS = ("lightning.pytorch.utilities.signature_utils", "lightning.pytorch.core.module",
                      "lightning.pytorch.core.optimizer", "lightning.pytorch.loops.training_epoch_loop",
                      "lightning.pytorch.loops.evaluation_loop", "lightning.pytorch.loops.prediction_loop",
                      "lightning.pytorch.loops.utilities", "lightning.pytorch.trainer.configuration_validator",
                      "lightning.pytorch.callbacks.prediction_writer")


def hook_signatures_read_once_in_place() -> None:
    """Make Lightning's ``is_param_in_hook_signature`` read a plain method's signature once per code object.

    The training epoch loop (does ``training_step`` take ``batch_idx``?) and ``LightningModule.log`` (does it take
    ``dataloader_iter``?) ask it on every step; it runs ``inspect.getfullargspec`` each time (tens of us on this CPU).
    For a bound method of a plain function without the attributes Lightning or getfullargspec would read
    (``__wrapped__``, ``__signature__``, ``_partialmethod``; a marker such as ``@override``'s ``__override__`` is
    none of them), the argument names and ``*args`` come from its code object alone, so they are kept per code
    object (a method given new code is read anew); anything else goes to Lightning's own, which stays reachable as
    ``__wrapped__``. Idempotent."""
    original = signature_utils.is_param_in_hook_signature
    if getattr(original, "_bfpp_once", False):
        return
    read: dict[int, tuple[types.CodeType, list[str], str | None]] = {}  # id(code) -> (code, args after self, varargs)

    @functools.wraps(original)
    def is_param_in_hook_signature(hook_fx: Callable, param: str, explicit: bool = False,
                                   min_args: int | None = None) -> bool:
        fn = getattr(hook_fx, "__func__", None) if type(hook_fx) is types.MethodType else None
        if type(fn) is not types.FunctionType or (fn.__dict__ and not _SIGNATURE_ATTRIBUTES.isdisjoint(fn.__dict__)):
            return original(hook_fx, param, explicit, min_args)
        code = fn.__code__
        known = read.get(id(code))
        if known is None or known[0] is not code:
            spec = inspect.getfullargspec(hook_fx)
            known = read[id(code)] = (code, spec.args[1:], spec.varargs)  # ignore `self`, as Lightning does
        _, args, varargs = known
        if param in args:
            return True
        takes_any = varargs is not None and not explicit  # *args may take it unless it must be named
        return takes_any or (isinstance(min_args, int) and len(args) >= min_args)

    is_param_in_hook_signature._bfpp_once = True  # type: ignore[attr-defined]
    for name in _SIGNATURE_READERS:
        module = importlib.import_module(name)
        if getattr(module, "is_param_in_hook_signature", None) is original:
            module.is_param_in_hook_signature = is_param_in_hook_signature


def skip_per_hook_bookkeeping_in_place() -> None:
    """The two bridges above, installed together (the strategy's setup for fitting)."""
    pass_through_profiles_without_generators_in_place()
    hook_signatures_read_once_in_place()


def restore_per_hook_bookkeeping() -> None:
    """Lightning's own functions back in place of the two bridges' (tests compare the two paths)."""
    installed = PassThroughProfiler.profile
    if getattr(installed, "_bfpp_passing", False):
        if installed._bfpp_had_own:
            PassThroughProfiler.profile = installed.__wrapped__  # type: ignore[method-assign]
        else:
            del PassThroughProfiler.profile  # Profiler.profile again (PassThroughProfiler defines none in 2.6.6)
    installed = signature_utils.is_param_in_hook_signature
    if getattr(installed, "_bfpp_once", False):
        for name in _SIGNATURE_READERS:
            module = importlib.import_module(name)
            if getattr(module, "is_param_in_hook_signature", None) is installed:
                module.is_param_in_hook_signature = installed.__wrapped__
