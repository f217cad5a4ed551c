"""A LightningModule written the way a Lightning user writes one (its own steps, torchmetrics, a scheduler),
plus the three pipeline hooks: bfpp must run the user's steps as written."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

from lightning_bfpp import PipelineHooks

# VAL: 62 = 2 x 31, so the evaluation loaders end in a ragged batch (14 samples per replica at dp=1, 7 at dp=2)
# that bfpp runs as fewer micro-batches; even, so dp=2 needs no padding
DIM, CLASSES, TRAIN, VAL = 12, 4, 64, 62


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + F.gelu(self.fc(self.norm(x)))


class Classifier(PipelineHooks, LightningModule):
    def __init__(self, width: int = 16, depth: int = 6, lr: float = 0.4):
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(DIM, width)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(depth))
        self.out = nn.Linear(width, CLASSES)
        self.train_acc = MulticlassAccuracy(CLASSES, average="micro")
        self.val_acc = MulticlassAccuracy(CLASSES, average="micro")
        self.val_auroc = MulticlassAUROC(CLASSES)  # list states (preds 2-d float, target int64)
        self.test_acc = MulticlassAccuracy(CLASSES, average="micro")
        self.val_losses: list[torch.Tensor] = []  # Lightning's pattern: collected per step, aggregated at epoch end
        self.val_samples = 0

    # the pipeline hooks
    def pipeline_layers(self):
        return [self.inp, *self.blocks, self.out]

    def pipeline_loss(self, output, target):
        return F.cross_entropy(output, target)

    def pipeline_train_metrics(self, output, target):
        self.train_acc(output.argmax(-1), target)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)

    # plain Lightning
    def forward(self, x):
        return self.pipeline_forward(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.pipeline_train_metrics(logits.detach(), y)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.val_acc(logits.argmax(-1), y)  # forward: also this batch's value
        self.log("val_acc", self.val_acc, prog_bar=True)
        self.val_auroc.update(logits.softmax(-1), y)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_loss_local", loss)  # not synced: this rank's (replica's) mean
        self.log("val_step_loss", loss, on_step=True, on_epoch=False)
        self.log("val_seen", float(len(y)), reduce_fx="sum", sync_dist=True)
        self.log_dict({"val_max_logit": logits.max()}, reduce_fx="max", sync_dist=True)
        self.val_losses.append(loss)
        self.val_samples += len(y)
        return {"n": len(y)}

    def on_validation_epoch_end(self):
        self.log("val_auroc", self.val_auroc.compute())  # compute() of the whole epoch, synced, on every rank
        self.val_auroc.reset()
        self.log("val_epoch_loss", torch.stack(self.val_losses).mean())  # this replica's batches
        self.log("val_batches", float(len(self.val_losses)), reduce_fx="sum", sync_dist=True)
        self.log("val_samples", float(self.val_samples), reduce_fx="sum", sync_dist=True)
        self.val_losses.clear()
        self.val_samples = 0

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.test_acc.update(logits.argmax(-1), y)  # update only: the epoch value
        self.log("test_acc", self.test_acc)
        loss = F.cross_entropy(logits, y)
        self.log("test_loss", loss, sync_dist=True)
        # collectives in a step: over the data-parallel replicas, as under DDP
        gathered = self.all_gather(loss)
        self.log_dict({"test_gathered": float(gathered.numel()), "test_gathered_loss": gathered.mean()})
        self.trainer.strategy.barrier()
        self.log("test_first_replica_loss", self.trainer.strategy.broadcast(loss.item(), 0))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def data(train: bool) -> TensorDataset:
    g = torch.Generator().manual_seed(7 if train else 8)
    n = TRAIN if train else VAL
    x = torch.randn(n, DIM, generator=g)
    return TensorDataset(x, (x[:, :CLASSES] + 0.5 * torch.randn(n, CLASSES, generator=g)).argmax(-1))


def loader(train: bool, batch_size: int) -> DataLoader:
    """Training batches all full; evaluation keeps every sample (a ragged last batch)."""
    return DataLoader(data(train), batch_size=batch_size, shuffle=False, drop_last=train)


class ReplicaOrder(Sampler):
    """One process's order equal to `replicas` data-parallel ranks under Lightning: its training sampler is a
    DistributedSampler (shuffle, seed 0, reshuffled each epoch); global batch t joins every replica's t-th batch."""

    def __init__(self, dataset, replicas: int, per_replica: int):
        self.samplers = [DistributedSampler(dataset, num_replicas=replicas, rank=r, shuffle=True, seed=0)
                         for r in range(replicas)]
        self.per_replica = per_replica

    def set_epoch(self, epoch: int) -> None:
        for s in self.samplers:
            s.set_epoch(epoch)

    def __len__(self) -> int:
        return sum(len(s) for s in self.samplers)

    def __iter__(self):
        orders, b = [list(s) for s in self.samplers], self.per_replica
        for t in range(len(orders[0]) // b):
            for order in orders:
                yield from order[t * b : (t + 1) * b]


def reference_loader(replicas: int, batch_size: int) -> DataLoader:
    """The training batches of `replicas` data-parallel ranks (global `batch_size`), for a one-process run."""
    ds = data(True)
    order = ReplicaOrder(ds, replicas, batch_size // replicas)
    return DataLoader(ds, batch_size=batch_size, sampler=order, drop_last=True)
