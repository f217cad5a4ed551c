"""A small GPT over windows that pack several documents, written the way a user adapts a model to context parallel:
positions restart at each document and attention stays within it, both from the document ids, through
``lightning_bfpp.contract.context_parallel`` (``whole_sequence``/``this_shard`` for the positions, ``causal_mask``
with ``document_ids`` for the mask, ``attention`` in the blocks). Its one-process reference is the same module's
``pipeline_forward`` (no shard: the helpers give the one-process values); `run` trains it under bfpp (a worker of
tests/run_context.py).

Batches are (tokens, document ids, next tokens): the inputs are (tokens, document ids), the target the next tokens,
-100 where the next token starts another document."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_bfpp import BFPPStrategy, PipelineHooks, mean_loss
from lightning_bfpp.contract.context_parallel import attention, causal_mask, this_shard, whole_sequence

VOCAB, SEQ, WIDTH, HEADS, LAYERS, SAMPLES, LR = 32, 16, 32, 4, 2, 32, 0.2


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions restarting at 0 where a document starts (and at each row's start)."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor, *, position_ids: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(position_ids)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                 nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, *, attn_mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # T: this rank's tokens under context parallel
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, HEADS, -1).permute(2, 0, 3, 1, 4)  # each (B, heads, T, hs)
        y = attention(q, k, v, attn_mask=attn_mask).transpose(1, 2).reshape(B, T, WIDTH)
        x = x + self.proj(y)
        return x + self.mlp(x)


class PackedGPT(PipelineHooks, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = Embedding()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embedding, *self.blocks, self.head]

    def pipeline_inputs(self, batch):
        tokens, documents, targets = batch
        return (tokens, documents), targets

    def pipeline_side_inputs(self, inputs) -> dict:
        tokens, documents = inputs  # this rank's shard under context parallel
        positions = this_shard(document_positions(whole_sequence(documents)))  # restart at each document
        return {"position_ids": positions, "attn_mask": causal_mask(tokens.shape[1], tokens.device,
                                                                    document_ids=documents)}

    def pipeline_context_parallel(self, layer_name: str, layer: nn.Module, context_parallel: int) -> bool:
        return True  # positions and masks from contract.context_parallel; attention through its `attention`

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor):
        targets = targets.reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets, ignore_index=-100, reduction="sum")
        return loss, (targets != -100).sum()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:  # (bfpp runs pipeline_loss instead)
        inputs, targets = self.pipeline_inputs(batch)
        return mean_loss(self.pipeline_loss(self.pipeline_forward(inputs), targets))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def dataset() -> TensorDataset:
    """Windows of SEQ tokens packing documents of 1..7 tokens (ids counting up along each row); the target of a
    document's last token is -100 (its next token belongs to another document)."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)
    starts = torch.rand(SAMPLES, SEQ, generator=g) < 0.3
    starts[:, 0] = True
    documents = starts.long().cumsum(1)
    targets = tokens[:, 1:].clone()
    targets[:, :-1][documents[:, 1:] != documents[:, :-1]] = -100
    return TensorDataset(tokens[:, :-1], documents, targets)


def lightning_batches(global_batch: int, data_parallel: int) -> list[tuple[torch.Tensor, ...]]:
    """The global batches Lightning's training sampler (shuffled, seed 0) yields over `data_parallel` replicas."""
    ds = dataset()
    per_rank = [list(DistributedSampler(ds, num_replicas=data_parallel, rank=r, shuffle=True, seed=0))
                for r in range(data_parallel)]
    b = global_batch // data_parallel
    return [tuple(t[idx] for t in ds.tensors) for s in range(len(per_rank[0]) // b)
            for idx in [[i for r in range(data_parallel) for i in per_rank[r][s * b:(s + 1) * b]]]]


def reference(steps: int, global_batch: int, data_parallel: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the same data and seed: SGD on the mean over each batch's counted targets."""
    torch.manual_seed(0)
    model = PackedGPT()
    opt = model.configure_optimizers()
    losses = []
    for tokens, documents, targets in lightning_batches(global_batch, data_parallel)[:steps]:
        total, counted = model.pipeline_loss(model.pipeline_forward((tokens, documents)), targets)
        opt.zero_grad()
        (total / counted).backward()
        opt.step()
        losses.append((total / counted).item())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def run(cfg: dict, devices: int, out: Path) -> None:
    """Train PackedGPT under bfpp (keys: pp, cp, loops, m, steps, batch); rank R writes out/rank{R}.pt =
    {"params": {name: full tensor}, "losses": [...]}."""
    from run_tp import Losses

    torch.manual_seed(0)
    model = PackedGPT()
    pp, cp = cfg.get("pp", 1), cfg.get("cp", 1)
    strategy = BFPPStrategy(pipeline_parallel=pp, context_parallel=cp, loops=cfg.get("loops", 1),
                            micro_batches=cfg.get("m"), timeout=timedelta(seconds=120))
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=cfg.get("steps", 3),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[losses])
    loader = DataLoader(dataset(), batch_size=cfg.get("batch", 8) // (devices // (pp * cp)), drop_last=True)
    trainer.fit(model, train_dataloaders=loader)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"params": params, "losses": losses.losses}, out / f"rank{trainer.global_rank}.pt")
