"""The smallest bfpp run: the README's quickstart as a file (tests/test_docs_snippets.py keeps the two equal).

    python examples/minimal.py

A LightningModule names its layers in order (``pipeline_layers``) and the loss of one micro-batch
(``pipeline_loss``); ``BFPPStrategy`` cuts the 4 layers into 4 stages, 2 per process (loops=2), runs the
breadth-first schedule over 4 micro-batches per step and shards each stage over the data-parallel ranks (here 1).
Without bfpp (``strategy="auto"``) the same module trains through its own ``training_step``. The full app (Hydra
settings, W&B, checkpoints, resume) is ``examples/train.py``.
"""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_bfpp import BFPPStrategy, PipelineHooks


class MLP(PipelineHooks, L.LightningModule):
    def __init__(self, width=32, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))

    def pipeline_layers(self):  # the model as an ordered list of layers: bfpp cuts it into stages
        return list(self.layers)

    def pipeline_loss(self, output, target):  # the loss of one micro-batch
        return nn.functional.mse_loss(output, target)

    def forward(self, x):  # the same model without bfpp
        return self.pipeline_forward(x)

    def training_step(self, batch, batch_idx):  # used as written without bfpp (strategy="auto")
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.log("train_loss", loss)  # bfpp logs train_loss itself
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


L.seed_everything(0)  # the ranks of a replica must load the same batches
data = DataLoader(TensorDataset(torch.randn(64, 32), torch.randn(64, 32)), batch_size=16, drop_last=True)
strategy = BFPPStrategy(pipeline_parallel=2, loops=2, micro_batches=4)  # 4 stages on 2 processes
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3)
trainer.fit(MLP(), data)
print(f"rank {trainer.global_rank}: train_loss {trainer.callback_metrics['train_loss']:.4f}")
