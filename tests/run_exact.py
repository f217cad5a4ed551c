"""Train StackNet with strategy=bfpp for several layouts in one launch of N CPU processes.

Usage: python tests/run_exact.py OUT_DIR DEVICES '[{"pp": 2, "loops": 2, "m": 2}, ...]'
Config keys: pp, loops, m, schedule, groups, sharding, reshard, steps, batch (global), accumulate, clip,
eval (validate/test/predict after fit), opt (sgd|adamw),
save (checkpoint folder written after fit), save_every + save_dir (ModelCheckpoint), resume (ckpt_path for fit), eval_ckpt (validate a checkpoint file instead of training), fail_rank (raise there in step 2), trace (record FSDP all-gathers / reduce-scatters of step 2). Rank R of config i writes
OUT_DIR/cfg{i}/rank{R}.pt = {"params": {global name: full tensor}, "local_shapes", "losses", "stats", "fsdp_trace"}.
Works under Lightning's own launcher (popen), torchrun and SLURM variables alike.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_model import StackNet, loader  # noqa: E402

from lightning_bfpp import BFPPStrategy  # noqa: E402


class Record(Callback):
    """Losses per batch; optionally the FSDP collectives actually issued during the second step."""

    def __init__(self, trace: bool, fail_rank: int | None = None):
        self.fail_rank = fail_rank
        self.losses: list[float] = []
        self.trace = trace
        self.events: list[tuple[str, int]] = []
        self._on = False

    def on_fit_start(self, trainer, pl_module):
        if not self.trace:
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg

        stage_of = {}
        for s, mod in trainer.strategy.runner.modules.items():
            for fp in fully_shard.state(mod)._fsdp_param_group.fsdp_params:
                stage_of[id(fp)] = s
        record = self

        def wrap(fn, kind):
            def inner(fsdp_params, *args, **kwargs):
                if record._on:
                    record.events.append((kind, stage_of[id(fsdp_params[0])]))
                return fn(fsdp_params, *args, **kwargs)

            return inner

        fpg.foreach_all_gather = wrap(fpg.foreach_all_gather, "UNSHARD")
        fpg.foreach_reduce = wrap(fpg.foreach_reduce, "REDUCE_GRAD")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._on = batch_idx == 1
        if batch_idx == 1 and trainer.global_rank == self.fail_rank:
            raise RuntimeError(f"injected failure on rank {trainer.global_rank}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._on = False
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def run(cfg: dict, devices: int, out: Path) -> None:
    torch.manual_seed(0)
    model = StackNet(opt=cfg.get("opt", "sgd"))
    strategy = BFPPStrategy(
        pipeline_parallel=cfg.get("pp", 1), loops=cfg.get("loops", 1), micro_batches=cfg.get("m"),
        schedule=cfg.get("schedule", "breadth_first"), groups=cfg.get("groups", 1),
        sharding=cfg.get("sharding", "full"), reshard_after_forward=cfg.get("reshard", False),
        timeout=timedelta(seconds=120),
    )
    record = Record(cfg.get("trace", False), cfg.get("fail_rank"))
    callbacks = [record]
    if cfg.get("save_every"):
        callbacks.append(ModelCheckpoint(dirpath=cfg["save_dir"], filename="{step}", every_n_train_steps=cfg["save_every"],
                                         save_top_k=-1))
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=cfg.get("steps", 3),
        accumulate_grad_batches=cfg.get("accumulate", 1), gradient_clip_val=cfg.get("clip"), logger=False,
        enable_checkpointing=bool(cfg.get("save_every")), enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=2 if cfg.get("eval") or cfg.get("eval_ckpt") else 0, val_check_interval=2, callbacks=callbacks,
    )
    dp = devices // cfg.get("pp", 1)
    per_replica = cfg.get("batch", 16) // dp
    evaluated = {}
    if cfg.get("eval_ckpt"):  # evaluate a checkpoint file in this layout, no training
        evaluated["val_loss"] = trainer.validate(model, loader(per_replica), ckpt_path=cfg["eval_ckpt"], verbose=False)[0]["val_loss"]
    else:
        trainer.fit(model, train_dataloaders=loader(per_replica), val_dataloaders=loader(per_replica),
                    ckpt_path=cfg.get("resume"))
    if cfg.get("save"):
        trainer.save_checkpoint(cfg["save"])
    if cfg.get("eval"):  # forward-only pipelines after training: validate, test, predict
        evaluated["val_loss"] = trainer.validate(model, loader(per_replica), verbose=False)[0]["val_loss"]
        evaluated["test_loss"] = trainer.test(model, loader(per_replica), verbose=False)[0]["test_loss"]
        evaluated["predictions"] = torch.cat(trainer.predict(model, loader(per_replica)))
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
    local = {n: tuple((p.to_local() if hasattr(p, "to_local") else p).shape) for n, p in model.named_parameters()}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"params": params, "local_shapes": local, "losses": record.losses, "stats": strategy.step_stats,
         "fsdp_trace": record.events, **evaluated, "cluster_env": type(trainer.strategy.cluster_environment).__name__, "schedule_fsdp": [(a.op.value, a.stage) for a in
                                                       strategy.schedule.fsdp_actions(strategy.device_mesh["pipeline_parallel"].get_local_rank())]},
        out / f"rank{trainer.global_rank}.pt",
    )


def main() -> None:
    out, devices, configs = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    for i, cfg in enumerate(configs):
        run(cfg, devices, out / f"cfg{i}")


if __name__ == "__main__":
    main()
