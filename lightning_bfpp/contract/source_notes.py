"""Notes on a user's LightningModule read from the source of its methods: what bfpp would run differently from
one process (rank-zero-only work on the last stage, a ``forward`` that skips the pipeline layers, training-step
logs, a custom ``backward``, batch normalization), told once at start with the contract line."""
from __future__ import annotations

import inspect
import re

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from .hooks import describe_contract

# what in a user's step only does something on global rank 0 (Lightning's rank-zero-only printing and loggers)
RANK_ZERO_ONLY = ("self.print(", "global_rank", "is_global_zero", "self.logger", "self.loggers", "rank_zero")
LAST_STAGE_METHODS = ("validation_step", "test_step", "predict_step", "pipeline_train_metrics")


def _user_source(module: nn.Module, method: str) -> str | None:
    """The source of `method` when the user's class defines it (not Lightning, torch or bfpp); None otherwise or when
    the source cannot be read."""
    fn = getattr(type(module), method, None)
    if fn is None or getattr(fn, "__module__", "").startswith(("lightning.", "lightning_bfpp.", "torch.")):
        return None
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def rank_zero_work_on_last_stage(module: nn.Module, pipeline_parallel: int) -> str | None:
    """A warning when a method bfpp runs only on the last stage's ranks (never global rank 0 when pipeline_parallel
    > 1) contains rank-zero-only work, which would then run on no rank; None when there is none (or no source)."""
    if pipeline_parallel <= 1:
        return None
    found = []
    for method in LAST_STAGE_METHODS:
        source = _user_source(module, method) or ""
        found += [f"{method} uses `{token.rstrip('(')}`" for token in RANK_ZERO_ONLY if token in source]
    if not found:
        return None
    return (f"bfpp: {type(module).__name__}.{'; '.join(found)}: with pipeline_parallel={pipeline_parallel} these "
            f"methods run only on the ranks of pipeline rank {pipeline_parallel - 1} (the last stage), never on global "
            "rank 0, so rank-zero-only work in them (self.print, `if self.global_rank == 0`, logger calls, "
            "logger.experiment) happens on no rank. Log with self.log (replayed on every rank), or do that work in a "
            "hook every rank runs: the step's return value reaches on_validation_batch_end / on_test_batch_end / "
            "on_predict_batch_end as `outputs` on every rank.")


def forward_not_the_pipeline(module: nn.Module) -> str | None:
    """A warning when the module's own `forward` does not go through its pipeline layers (bfpp never calls it: training
    and ``self(x)`` in the user's steps are the layers of ``pipeline_layers()`` in order), so whatever else it does
    would be silently left out; None when it calls ``pipeline_forward``/``pipeline_layers`` (or has no source)."""
    source = _user_source(module, "forward")
    if source is None or "pipeline_forward" in source or "pipeline_layers" in source:
        return None
    return (f"bfpp: {type(module).__name__}.forward is never called under strategy='bfpp': training and self(x) in "
            "your steps run the layers of pipeline_layers() in order. Anything else forward does (another order, extra "
            "modules or arithmetic between layers) is left out; write it as `return self.pipeline_forward(x)` so both "
            "are the same (docs/adapting.md).")


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


_LOGGED_NAME = re.compile(r"""self\.log\(\s*f?["']([^"']+)["']|self\.log_dict\(""")


def _logged_names(source: str | None) -> set[str]:
    """The names a method's source logs with self.log("name", ...) ("self.log_dict(...)" for a log_dict call)."""
    return {m.group(1) or "self.log_dict(...)" for m in _LOGGED_NAME.finditer(source or "")}


def not_run_as_written(module: nn.Module, micro_batches: int) -> list[str]:
    """Warnings for what the module defines that bfpp runs differently from one process: the logs of its own
    ``training_step`` (not run), its own ``backward`` (the schedule runs backward per micro-batch) and batch
    normalization (statistics per micro-batch)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    name, found = type(module).__name__, []
    lost = _logged_names(_user_source(module, "training_step")) - {"train_loss"} \
        - _logged_names(_user_source(module, "pipeline_train_metrics"))
    if lost:
        found.append(
            f"bfpp: {name}.training_step logs {', '.join(sorted(lost))}, which will not be logged: under "
            "strategy='bfpp' training_step does not run (each step runs the pipeline schedule and logs train_loss). "
            "Log training metrics from pipeline_train_metrics(output, target), which runs once per step on the last "
            "stage with the step's output.")
    if is_overridden("backward", module):
        found.append(
            f"bfpp: {name}.backward is never called under strategy='bfpp': the schedule runs backward of every "
            "micro-batch itself and hands the gradients to Lightning's backward step, so anything your backward adds "
            "(a scaled loss, retain_graph, extra terms) is left out. Put gradient changes in on_after_backward or "
            "on_before_optimizer_step (they run as usual), and loss terms in pipeline_loss.")
    norms = [n for n, m in module.named_modules() if isinstance(m, BATCH_NORMS)]
    if norms and micro_batches > 1:
        found.append(
            f"bfpp: {name} has batch normalization ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}): with "
            f"micro_batches={micro_batches} it normalizes each micro-batch (the replica's batch / {micro_batches}) and "
            f"updates its running statistics {micro_batches} times per step, so training differs from one process "
            "with the whole batch (as under gradient accumulation). Use LayerNorm or GroupNorm for results that do "
            "not depend on the micro-batch size.")
    return found


def contract_notes(module: nn.Module, pipeline_parallel: int, micro_batches: int) -> tuple[str, list[str]]:
    """What bfpp tells the user once, at start: the contract line (``describe_contract``) and the warnings about
    methods that will not run as written."""
    warnings = (rank_zero_work_on_last_stage(module, pipeline_parallel), forward_not_the_pipeline(module),
                *not_run_as_written(module, micro_batches))
    return describe_contract(module), [w for w in warnings if w is not None]


def announce_contract(module: nn.Module, pipeline_parallel: int, micro_batches: int) -> None:
    """Say `contract_notes` once, on global rank 0: the contract line as information, the rest as warnings."""
    line, warnings = contract_notes(module, pipeline_parallel, micro_batches)
    rank_zero_info(line)
    for warning in warnings:
        rank_zero_warn(warning)
