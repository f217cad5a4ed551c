"""What a newcomer's run prints: tests/user_module.Classifier under strategy=bfpp (pp=2 x loops=2), as a Lightning user
trains it: the model summary on, no progress bar, PipelineMetrics, a ModelCheckpoint mid-epoch and a save of their own.

Usage: python tests/run_output.py OUT_DIR DEVICES MODE
MODE "full": fit 3 steps (log_every_n_steps=2; checkpoints at steps 2 of the 4-batch epoch), save OUT_DIR/user.ckpt
with trainer.save_checkpoint(path), then fit again from the step-2 checkpoint to step 4 (an exact mid-epoch resume).
MODE "threads": fit 1 step. Rank R writes OUT_DIR/rank{R}.json = {"threads": [torch.get_num_threads() at each fit's
start], "global_steps": [...], "params": the whole model's parameter count}. Works under Lightning's own launcher,
torchrun and SLURM variables alike; the test reads what every rank printed.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from user_module import Classifier, loader

from lightning_bfpp import BFPPStrategy, PipelineMetrics


class Threads(Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen.append(torch.get_num_threads())


def fit(out: Path, devices: int, threads: Threads, max_steps: int, ckpt_path: str | None = None) -> Trainer:
    seed_everything(0)
    checkpoints = ModelCheckpoint(dirpath=out / "ckpt", filename="step-{step}", every_n_train_steps=2, save_top_k=-1,
                                  auto_insert_metric_name=False)
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=BFPPStrategy(pipeline_parallel=2, loops=2),
                      max_steps=max_steps, log_every_n_steps=2, enable_progress_bar=False, logger=False,
                      enable_model_summary=True, num_sanity_val_steps=0, limit_val_batches=0,
                      callbacks=[threads, PipelineMetrics(), checkpoints])
    trainer.fit(Classifier(), loader(True, 16), ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    out, devices, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # PipelineMetrics' lines (Lightning has its own)
    threads = Threads()
    trainer = fit(out, devices, threads, max_steps=1 if mode == "threads" else 3)
    steps = [trainer.global_step]
    if mode == "full":
        trainer.save_checkpoint(out / "user.ckpt")  # as docs/checkpoints.md shows it
        steps.append(fit(out, devices, threads, max_steps=4, ckpt_path=str(out / "ckpt" / "step-2.ckpt")).global_step)
    params = sum(p.numel() for p in Classifier().parameters())
    record = {"threads": threads.seen, "global_steps": steps, "params": params}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
