"""Train a tiny example GPT with strategy=bfpp and tensor parallel, several layouts in one launch of N CPU processes.

Usage: python tests/run_tp.py OUT_DIR DEVICES '[{"pp": 2, "tp": 2, "m": 2}, ...]'
Config keys: pp, tp, sp (sequence parallel), cp (context parallel), compile, loops, m, schedule, sharding, steps
(max_steps), batch (global), opt (sgd|adamw), clip, ac, precision, tied (embedding tied to the head), ignored (prompt
and padding targets of -100), accumulate (accumulate_grad_batches), save_every + save_dir (ModelCheckpoint
"step=N.ckpt"), resume (ckpt_path), packed (rows packing 2-4 documents, tests/packed_rows.py; after fit the logits of
the first `batch` rows are predicted: "predicted", replica r of dp predicting rows r, r + dp, ...: "replica" (r, dp)),
moe (a mixture of 4 experts, 2 per token, in every block, with its router loss), ep (expert_parallel).
Rank R of config i writes OUT_DIR/cfg{i}/rank{R}.pt = {"params": {global name: full tensor}, "local_shapes",
"tp_split": names split over tensor parallel, "losses", "memory": this rank's parameter/gradient/optimizer bytes,
"message_bytes": the largest activation message it sent, "kv_gather_bytes": the keys and values one attention layer
all-gathered (context parallel; the largest over ranks)}.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
from exact_compare import PRECISION
from gpt import GPT, GPTConfig, OptimConfig
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from packed_rows import PackedRows
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.layout.tensor_parallel import tp_sharded

SAMPLES, BLOCK, VOCAB = 64, 8, 32


def model_config(tied: bool = False, moe: bool = False) -> GPTConfig:
    experts = dict(n_experts=4, top_k=2, router_aux_loss_coef=0.5) if moe else {}
    return GPTConfig(n_layer=4, n_head=4, n_embd=32, block_size=BLOCK, vocab_size=VOCAB, tie_weights=tied, **experts)


def optim_config(opt: str = "sgd") -> OptimConfig:
    """A constant learning rate (no warmup, no decay): the reference needs no scheduler. AdamW's eps is 1e-6, not
    torch's 1e-8: its update lr * m / (sqrt(v) + eps) turns a gradient's rounding error into a weight change of up to
    lr / eps times it where |gradient| <~ eps (the attention key biases' gradients are zero but for rounding). At 1e-6
    that amplification is 1e3 x float64's rounding, far below the exactness bound (tests/exact_compare.py), while a lost
    or mis-sharded AdamW state still moves weights by ~lr = 1e-3."""
    return OptimConfig(name=opt, lr=0.1 if opt == "sgd" else 1e-3, warmup_steps=0, min_lr_ratio=1.0, eps=1e-6)


def dataset(ignored: bool = False) -> TensorDataset:
    """(tokens, next tokens); `ignored`: each row's prompt and padding, of random lengths, have -100 targets (not
    counted by the loss), as fine-tuning data has."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (SAMPLES, BLOCK + 1), generator=g)
    targets = tokens[:, 1:].clone()
    if ignored:
        prompt = torch.randint(0, BLOCK // 2, (SAMPLES, 1), generator=g)
        padding = torch.randint(0, 3, (SAMPLES, 1), generator=g)
        position = torch.arange(BLOCK)
        targets[(position < prompt) | (position >= BLOCK - padding)] = -100
    return TensorDataset(tokens[:, :-1], targets)


def lightning_batches(global_batch: int, data_parallel: int,
                      ignored: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches Lightning's training sampler (shuffled, seed 0) yields over `data_parallel` replicas."""
    ds = dataset(ignored)
    per_rank = [list(DistributedSampler(ds, num_replicas=data_parallel, rank=r, shuffle=True, seed=0))
                for r in range(data_parallel)]
    b = global_batch // data_parallel
    return [(ds.tensors[0][idx], ds.tensors[1][idx]) for t in range(len(per_rank[0]) // b)
            for idx in [[i for r in range(data_parallel) for i in per_rank[r][t * b:(t + 1) * b]]]]


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def run(cfg: dict, devices: int, out: Path) -> None:
    torch.manual_seed(0)
    model = GPT(model_config(cfg.get("tied", False), cfg.get("moe", False)), optim_config(cfg.get("opt", "sgd")))
    pp, tp, cp = cfg.get("pp", 1), cfg.get("tp", 1), cfg.get("cp", 1)
    strategy = BFPPStrategy(
        pipeline_parallel=pp, tensor_parallel=tp, sequence_parallel=cfg.get("sp"), loops=cfg.get("loops", 1),
        context_parallel=cp,
        micro_batches=cfg.get("m"),
        schedule=cfg.get("schedule", "breadth_first"), sharding=cfg.get("sharding", "full"),
        activation_checkpointing=cfg.get("ac", False), timeout=timedelta(seconds=120), expert_parallel=cfg.get("ep", 1),
        compile=cfg.get("compile", False),
    )
    losses = Losses()
    callbacks: list[Callback] = [losses]
    if cfg.get("save_every"):
        callbacks.append(ModelCheckpoint(dirpath=cfg["save_dir"], filename="{step}",
                                         every_n_train_steps=cfg["save_every"], save_top_k=-1))
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=cfg.get("steps", 3),
        precision=cfg.get("precision", PRECISION), gradient_clip_val=cfg.get("clip"), logger=False,
        accumulate_grad_batches=cfg.get("accumulate", 1),
        enable_checkpointing=bool(cfg.get("save_every")), enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=callbacks,
    )
    dp = devices // (pp * tp * cp)
    data = PackedRows(SAMPLES, BLOCK, VOCAB) if cfg.get("packed") else dataset(cfg.get("ignored", False))
    loader = DataLoader(data, batch_size=cfg.get("batch", 8) // dp, shuffle=False, drop_last=True)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=cfg.get("resume"))
    predicted = None
    if cfg.get("packed"):  # the trained model's logits of packed rows (no labels), on the last stage's ranks
        rows = torch.utils.data.Subset(PackedRows(SAMPLES, BLOCK, VOCAB, labels=False), range(cfg.get("batch", 8)))
        logits = trainer.predict(model, DataLoader(rows, batch_size=cfg.get("batch", 8)))
        predicted = torch.cat(logits) if logits and all(isinstance(o, torch.Tensor) for o in logits) else None
    named = list(model.named_parameters())
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in named}
    local = {n: tuple((p.to_local() if hasattr(p, "to_local") else p).shape) for n, p in named}
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"params": params, "local_shapes": local, "tp_split": sorted(n for n, p in named if tp_sharded(p)),
                "losses": losses.losses, "memory": strategy.step_stats.get("memory", {}).get(trainer.global_rank),
                "message_bytes": strategy.runner.message_bytes, "predicted": predicted,
                "kv_gather_bytes": strategy.step_stats.get("kv_gather_bytes"),
                "replica": (strategy.distributed_sampler_kwargs["rank"],
                            strategy.distributed_sampler_kwargs["num_replicas"])},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    from launch import run_configs

    run_configs(run)
