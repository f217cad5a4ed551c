"""Lightning's own output, made true of a bfpp run. Its model summary tabulates the modules of one rank, where the
layers of the other pipeline ranks are ``RemoteLayer`` placeholders with no parameters: under bfpp it says whose
stages its rows are and totals the whole model. A save prints "`weights_only` was not set, defaulting to `False`" on
every rank, which reads like unsafe loading; a bfpp save writes the whole state and loads without running code from
the file (``checkpoint.safety``), so the line is left out."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from .._private.lightning_api import CHECKPOINT_CONNECTOR_LOGGER, model_summary_settings
from ..dims import ParallelDims

WEIGHTS_ONLY_DEFAULT = "`weights_only` was not set, defaulting to `False`."  # Lightning's dump_checkpoint


@dataclass(frozen=True)
class ParameterCount:
    """The whole model's parameters (a weight shared by several layers counted once), counted before the cut."""

    total: int
    trainable: int
    megabytes: float

    @classmethod
    def of(cls, module: nn.Module) -> ParameterCount:
        params = list(module.parameters())  # each Parameter once
        return cls(sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad),
                   sum(p.numel() * p.element_size() for p in params) / 1e6)


class _StageSummary(ModelSummary):
    """Lightning's summary, its rows this rank's modules, its totals the whole model's, after a line saying so."""

    whole: ParameterCount
    note: str

    def summarize(self, summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        rank_zero_info(self.note)
        super().summarize(summary_data, self.whole.total, self.whole.trainable, self.whole.megabytes,
                          total_training_modes, total_flops, **summarize_kwargs)


class _RichStageSummary(_StageSummary, RichModelSummary):
    """The same over RichModelSummary (Lightning's default when `rich` is installed)."""


class _NoWeightsOnlyLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != WEIGHTS_ONLY_DEFAULT


def summary_note(dims: ParallelDims, global_rank: int) -> str:
    """What the summary of `global_rank` (the one that prints it) shows."""
    pipeline_rank = dims.coordinates(global_rank).pipeline
    stages = dims.spec.local_stages(pipeline_rank)
    return (f"bfpp: the model summary shows global rank {global_rank}'s modules: pipeline rank {pipeline_rank}'s "
            f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))} of {dims.num_stages}; the layers of "
            "the other pipeline ranks are RemoteLayer placeholders with 0 params here. Its totals are the whole "
            "model's.")


def adapt_lightning_output(callbacks: list, whole: ParameterCount, dims: ParallelDims, global_rank: int) -> None:
    """Replace the trainer's model summary (`callbacks`: ``trainer.callbacks``) by one that says what it shows and
    totals `whole`; leave the weights_only line out of saves."""
    for i, callback in enumerate(callbacks):
        if isinstance(callback, ModelSummary) and not isinstance(callback, _StageSummary):
            kind = _RichStageSummary if isinstance(callback, RichModelSummary) else _StageSummary
            max_depth, kwargs = model_summary_settings(callback)
            callbacks[i] = kind(max_depth, **kwargs)
            callbacks[i].whole, callbacks[i].note = whole, summary_note(dims, global_rank)
    connector_log = logging.getLogger(CHECKPOINT_CONNECTOR_LOGGER)
    if not any(isinstance(f, _NoWeightsOnlyLine) for f in connector_log.filters):
        connector_log.addFilter(_NoWeightsOnlyLine())
