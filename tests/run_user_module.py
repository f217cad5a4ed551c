"""Fit, validate, test and predict tests/user_module.Classifier with the callbacks a Lightning user adds.

Usage: python tests/run_user_module.py OUT_DIR DEVICES '[{"strategy": "auto", "dp": 2} | {"pp": 2, "loops": 2}, ...]'
("auto" on one process draws the training batches of `dp` data-parallel ranks, the order bfpp's replicas see.)
Rank R of config i writes OUT_DIR/cfg{i}/rank{R}.pt = {"fit", "validate", "test": callback_metrics after each,
"logged": logged_metrics after fit, "predictions", "best_score", "stopped_epoch", "global_step", "csv" (rank 0:
the CSV logger's rows)}.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from exact_compare import PRECISION
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from user_module import Classifier, loader, reference_loader

from lightning_bfpp import BFPPStrategy

GLOBAL_BATCH = 16


def _floats(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def run(cfg: dict, devices: int, out: Path) -> None:
    seed_everything(0)
    model = Classifier()
    strategy = "auto" if cfg.get("strategy") == "auto" else BFPPStrategy(
        pipeline_parallel=cfg.get("pp"), loops=cfg.get("loops", 1), micro_batches=cfg.get("m"))
    dp = devices // (cfg.get("pp") or devices) if strategy != "auto" else devices
    best = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_acc", mode="max", save_top_k=1)
    # no epoch improves val_acc by 0.5: the run stops after its second epoch (of 4)
    stop = EarlyStopping(monitor="val_acc", mode="max", patience=0, min_delta=0.5)
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=4, logger=CSVLogger(out, name="csv"),
        callbacks=[best, stop, LearningRateMonitor(logging_interval="epoch")], log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        precision=PRECISION,  # float64 both: the metrics are compared where rounding cannot decide
    )
    per_replica = GLOBAL_BATCH // dp
    train = reference_loader(cfg.get("dp", 1), GLOBAL_BATCH) if strategy == "auto" else loader(True, per_replica)
    trainer.fit(model, train, loader(False, per_replica))
    record = {"fit": _floats(trainer.callback_metrics), "logged": _floats(trainer.logged_metrics),
              "best_score": float(best.best_model_score), "stopped_epoch": stop.stopped_epoch,
              "global_step": trainer.global_step}
    trainer.validate(model, loader(False, per_replica), verbose=False)
    record["validate"] = _floats(trainer.callback_metrics)
    trainer.test(model, loader(False, per_replica), verbose=False)
    record["test"] = _floats(trainer.callback_metrics)
    record["predictions"] = torch.cat(trainer.predict(model, loader(False, per_replica)))
    if trainer.is_global_zero:
        with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
            record["csv"] = list(csv.DictReader(f))
    out.mkdir(parents=True, exist_ok=True)
    torch.save(record, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    from launch import run_configs

    run_configs(run)
