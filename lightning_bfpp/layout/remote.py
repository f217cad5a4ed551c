"""What stands in the LightningModule for a layer that lives on another pipeline rank after the cut
(`RemoteLayer`), and the check that a model was not cut already."""
from __future__ import annotations

from torch import nn


class RemoteLayer(nn.Module):
    """Placeholder for a layer that lives on another pipeline rank (keeps ModuleList indices)."""

    def __init__(self, name: str, stage: int, rank: int):
        super().__init__()
        self.where = f"{name} (stage {stage}, pipeline rank {rank})"

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"layer {self.where} lives on another pipeline rank: under strategy='bfpp' the model runs through the "
            "pipeline. In validation_step/test_step/predict_step call self(x) (it returns the pipeline's output); "
            "outside the Trainer, export the checkpoint (python -m lightning_bfpp.checkpoint) and load it in one "
            "process."
        )

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            where = self.__dict__.get("where", "a layer")
            raise AttributeError(
                f"layer {where} lives on another pipeline rank: `.{name}` is not on this one. Code every rank runs "
                "(configure_optimizers, callbacks) should take parameters from self.named_parameters() or a "
                "module's .parameters() (this rank's own: empty for a layer that lives elsewhere), not from a layer's "
                "attributes."
            ) from None

    def extra_repr(self) -> str:
        return self.where


def check_not_cut(root: nn.Module) -> None:
    """Raise when an earlier bfpp run in this process has cut `root`: its other ranks' layers are placeholders."""
    remote = [m.where for m in root.modules() if isinstance(m, RemoteLayer)]
    if remote:
        raise RuntimeError(
            f"{type(root).__name__} was already cut into pipeline stages by an earlier Trainer(strategy='bfpp') in "
            f"this process: {len(remote)} of its layers (e.g. {remote[0]}) hold no weights here, they live on other "
            "ranks, so a new Trainer cannot cut it again. Reuse that Trainer (its fit/validate/test/predict keep the "
            "cut), or build a new model for the new Trainer (to continue training: trainer.fit(new_model, "
            "ckpt_path=<checkpoint>), which loads into any layout)."
        )
