"""What a NaN/inf training loss does. The loss is shared over every rank before this runs, so every rank
takes the same branch at once: stop before the optimizer step, or skip the batch (within a bound)."""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ..schedule.checks import is_count

NONFINITE_LOSS = ("stop", "skip")


class NonfiniteLoss:
    """`policy` "stop" raises; "skip" drops the batch's gradients, and more than `max_consecutive` skipped in a
    row raise. Counts `skipped` (logged as ``skipped_batches``)."""

    def __init__(self, policy: str = "stop", max_consecutive: int = 5) -> None:
        if policy not in NONFINITE_LOSS:
            raise ValueError(f"nonfinite_loss={policy!r} must be one of {NONFINITE_LOSS}: stop the run, or skip "
                             "the step.")
        if not is_count(max_consecutive):
            raise ValueError(f"max_consecutive_skips={max_consecutive!r} must be a positive integer (default 5).")
        self.policy, self.max_consecutive = policy, max_consecutive
        self.skipped = 0
        self.consecutive = 0

    def finite(self) -> None:
        """A finite step ends a run of skipped ones."""
        self.consecutive = 0

    def nonfinite(self, where: str) -> str:
        """A non-finite loss (`where`: the value and the step): raise, or return the warning of a skipped batch."""
        if self.policy == "stop":
            raise FloatingPointError(
                f"{where}: stopping every rank before the optimizer step, so the weights and the last checkpoint are "
                "the last good ones. Check the data and the learning rate, or set nonfinite_loss='skip' (Hydra: "
                "schedule.nonfinite_loss=skip) to drop such batches."
            )
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive > self.max_consecutive:
            raise FloatingPointError(
                f"{where}: {self.consecutive} batches in a row had a non-finite loss (nonfinite_loss='skip' "
                f"allows max_consecutive_skips={self.max_consecutive}): the weights are likely poisoned (e.g. "
                "by a huge update). Stopping every rank; lower the learning rate or resume from an earlier checkpoint "
                "(Hydra: schedule.max_consecutive_skips=N raises the bound)."
            )
        return (f"{where}: dropped that batch's gradients (nonfinite_loss='skip', {self.skipped} so far, "
                f"{self.consecutive} in a row).")

    def keep(self, loss: torch.Tensor, module: Any, batch_idx: int | None) -> bool:
        """Whether the step of the (shared) `loss` goes on to the optimizer: True when finite; else raise, or log
        ``skipped_batches``, warn and return False (the caller drops the batch's gradients)."""
        if torch.isfinite(loss):
            self.finite()
            return True
        trainer = module.trainer
        warning = self.nonfinite(f"train_loss={loss.item()} at global step {trainer.global_step} (epoch "
                                 f"{trainer.current_epoch}, batch {batch_idx})")
        module.log("skipped_batches", float(self.skipped), batch_size=1)
        rank_zero_warn(warning)
        return False
