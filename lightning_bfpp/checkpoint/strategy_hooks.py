"""The strategy's checkpoint hooks (Lightning's ``Strategy.save_checkpoint`` / ``load_checkpoint`` /
``optimizer_state``), as a mixin: what a Trainer save or restore becomes under bfpp — a sharded folder keyed by the
model's own names, written by every rank (atomically, or in the background with ``async_save`` while fitting), read
into any layout without running code from the files."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from .._private.lightning_api import unwrap_optimizer
from .loading import load
from .saving import save_trainer_checkpoint
from .state import optimizer_state


class CheckpointHooks:
    """Mixin for the strategy (needs ModelParallelStrategy's `model`, `optimizers`, `lightning_module`, `broadcast`,
    and the strategy's `runner`, `plan`, `stage_layer_names`, `param_order`, `tied`, `async_save`, `_saves`,
    `storage` and `trust_checkpoints`)."""

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return optimizer_state(self.model, unwrap_optimizer(optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("strategy='bfpp' writes torch.distributed.checkpoint folders; storage_options is not "
                            "supported.")
        trainer = self.lightning_module.trainer
        self.runner is not None and self.runner.settle()
        fitting = trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING
        save_trainer_checkpoint(
            Path(self.broadcast(filepath)), checkpoint, self.model, [unwrap_optimizer(o) for o in self.optimizers],
            layout=self.plan.checkpoint_meta(self.stage_layer_names), param_order=self.param_order,
            aliases=self.tied.aliases() if self.tied is not None else {},
            background=self._saves if self.async_save and fitting else None, storage=self.storage)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        optimizers = [unwrap_optimizer(o) for o in self.optimizers]
        aliases = self.tied.aliases() if self.tied is not None else None
        # every rank checks the checkpoint (under torchrun/SLURM no launcher has) and loads without running code
        return load(path, self.model, optimizers, strict=self.lightning_module.strict_loading, aliases=aliases,
                    trust=self.trust_checkpoints, param_order=self.param_order)
