"""Train StackNet with strategy=bfpp for several layouts in one launch of N CPU processes.

Usage: python tests/run_exact.py OUT_DIR DEVICES '[{"pp": 2, "loops": 2, "m": 2}, ...]'
Config keys: pp, loops, m,
schedule, groups, sharding, reshard, steps, batch (global), accumulate, clip, eval (validate/test/predict after fit),
opt (sgd|adamw|adamw_groups), save (checkpoint folder written after fit), save_every + save_dir (ModelCheckpoint),
resume (ckpt_path for fit), eval_ckpt (validate a checkpoint file instead of training), fail_rank (raise there in step
2), hang_rank (sleeps in step 2), timeout (seconds, default 120), wide_batch (an extra input feature at that batch
index), nan_batch (NaN in one sample of data-parallel replica 0 at that batch index), own_batch (rank 1 alone changes
its batch at that index), nonfinite (stop|skip), pid_dir (rank R writes its pid to pid_dir/rankR once step 1 runs, its
global step to pid_dir/stepR after every batch, and pid_dir/exceptionR = "<global step> <error>" when its run raises),
on_signal (save|exit) + grace (signal_grace_s), root (default_root_dir; default OUT_DIR/cfg<i>), async_save, step_sleep
(seconds per batch), tied (StackNet with its input projection tied to a layer before the head; records every step's
copies), trace (record FSDP all-gathers / reduce-scatters of step 2), precision (Trainer's, default "64-true": exactness
is compared in float64, tests/exact_compare.py), ac (activation_checkpointing), compile (compiled layers), late_rank +
late_s (that local rank sleeps before its process group exists), meta (true: built on the meta device by
trainer.init_module(empty_init=True); "configure_model": LateStackNet, built there on the meta device), counter
(StackNet with two stateful parameter-free layers, in the first and the last stage; records every buffer), counted
(about 40 % of the targets ignored, pipeline_loss returning (loss_sum, num_items)), disk_quota (save_dir holds at most
that many bytes of checkpoint files, like a small disk: tests/full_disk.py), timeline_trace (PipelineTrace of the last
step into OUT_DIR/cfg<i>/traces; its files in the record's "traces" on rank 0), cross_step (cross_step_overlap; the
record's "prefetches": the steps whose first gathers started early), shard_unit ("layer": each layer its own FSDP
unit; the trace's events are then (collective, stage, unit) with units in the stage's module order).

Every run also records "dtypes": p2p receive buffers per (mode, stage), FSDP all-gather / reduce-scatter tensors,
gradients. Rank R of config i writes OUT_DIR/cfg{i}/rank{R}.pt = {"params": {global name: full tensor},
"local_shapes", "losses", "stats", "fsdp_trace"}.
Works under Lightning's own launcher (popen), torchrun and SLURM variables alike.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
from exact_compare import PRECISION
from exact_model import LateStackNet, StackNet, loader
from full_disk import limited
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bfpp import BFPPStrategy, PipelineTrace


class Record(Callback):
    """Losses per batch; optionally the FSDP collectives actually issued during the second step."""

    def __init__(self, trace: bool, fail_rank: int | None = None, cfg: dict | None = None):
        self.fail_rank = fail_rank
        self.cfg = cfg or {}
        self.tied_history: dict[str, list[torch.Tensor]] = {}
        self.losses: list[float] = []
        self.skipped: list[float | None] = []  # the logged skipped_batches after each step (None: not logged yet)
        self.grad_dtypes: dict[str, str] = {}
        self.trace = trace
        self.events: list[tuple[str, int]] = []
        self.units: dict[int, int] = {}  # FSDP units with parameters, per local stage (trace)
        self.arriving: list[tuple[int, int]] = []  # (stage, its units not waited for yet) at its first layer's forward
        self._on = False

    def on_fit_start(self, trainer, pl_module):
        if not self.trace:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg

        stage_of = {}  # an FSDP parameter -> (its stage, its unit's position among the stage's units)
        for s, mod in trainer.strategy.runner.modules.items():
            units = [m for m in mod.modules() if isinstance(m, FSDPModule) and fully_shard.state(m)._fsdp_param_group]
            self.units[s] = len(units)
            if self.cfg.get("shard_unit") == "layer":  # at its first layer's forward: the stage's units still gathering
                units[0].register_forward_pre_hook(self._arriving(s, [fully_shard.state(u)._fsdp_param_group
                                                                      for u in units]))
            for u, unit in enumerate(units):
                for fp in fully_shard.state(unit)._fsdp_param_group.fsdp_params:
                    stage_of[id(fp)] = (s, u)
        record = self

        def wrap(fn, kind):
            def inner(fsdp_params, *args, **kwargs):
                if record._on:
                    stage, unit = stage_of[id(fsdp_params[0])]
                    record.events.append((kind, stage) + ((unit,) if record.cfg.get("shard_unit") == "layer" else ()))
                return fn(fsdp_params, *args, **kwargs)

            return inner

        fpg.foreach_all_gather = wrap(fpg.foreach_all_gather, "UNSHARD")
        fpg.foreach_reduce = wrap(fpg.foreach_reduce, "REDUCE_GRAD")

    def _arriving(self, stage: int, groups: list):
        def hook(*_) -> None:
            if self._on:
                self.arriving.append((stage, sum(g._all_gather_result is not None for g in groups[1:])))

        return hook

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._on = batch_idx == 1
        if batch_idx == 1 and trainer.global_rank == self.fail_rank:
            raise RuntimeError(f"injected failure on rank {trainer.global_rank}")
        if batch_idx == 1 and trainer.global_rank == self.cfg.get("hang_rank"):
            time.sleep(3600)  # alive but stuck: the others' distributed waits must time out
        if self.cfg.get("pid_dir") and trainer.global_step == 1:  # training is under way: tell the test who is who
            Path(self.cfg["pid_dir"], f"rank{trainer.global_rank}").write_text(str(os.getpid()))
        time.sleep(self.cfg.get("step_sleep", 0))
        if batch_idx == self.cfg.get("wide_batch"):  # a batch the first layer cannot take (one feature too many)
            batch[0] = torch.cat([batch[0], batch[0][:, :1]], dim=1)
        if batch_idx == self.cfg.get("own_batch") and trainer.global_rank == 1:  # this rank drew another batch
            batch[0] = batch[0] + 1
        nan_here = batch_idx == self.cfg.get("nan_batch")
        if nan_here and trainer.strategy.device_mesh["data_parallel"].get_local_rank() == 0:
            batch[0][0, 0] = float("nan")  # one bad sample in one data-parallel replica

    def on_exception(self, trainer, pl_module, exception):
        if self.cfg.get("pid_dir"):
            Path(self.cfg["pid_dir"], f"exception{trainer.global_rank}").write_text(
                f"{trainer.global_step} {type(exception).__name__}: {exception}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._on = False
        if self.cfg.get("pid_dir"):  # the steps this rank has trained
            Path(self.cfg["pid_dir"], f"step{trainer.global_rank}").write_text(str(trainer.global_step))
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        skipped = trainer.callback_metrics.get("skipped_batches")
        self.skipped.append(None if skipped is None else float(skipped))
        if self.cfg.get("tied"):  # this rank's copies of the tied matrix after every step
            for name, p in pl_module.named_parameters():
                if name in ("embed.weight", "unembed.weight"):
                    self.tied_history.setdefault(name, []).append(_full(p))
        # gradients of the last step (Lightning's evaluation loop zeroes them before validating)
        self.grad_dtypes = {n: str(p.grad.dtype) for n, p in pl_module.named_parameters() if p.grad is not None}


def _full(p: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor (gathered from its shards when it is a DTensor)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


COMM_DTYPES: set[tuple[str, str]] = set()  # (FSDP collective, dtype of the tensor it moves)


def _record_fsdp_comm_dtypes() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    for cls, kind in ((fc.DefaultAllGather, "all_gather"), (fc.DefaultReduceScatter, "reduce_scatter")):
        def call(self, *args, _inner=cls.__call__, _kind=kind, **kwargs):
            sent = kwargs["input_tensor"] if "input_tensor" in kwargs else args[1]
            COMM_DTYPES.add((_kind, str(sent.dtype)))
            return _inner(self, *args, **kwargs)

        cls.__call__ = call


def _dtypes(strategy, grads: dict[str, str]) -> dict:
    """What moved in which dtype: p2p receive buffers of every runtime (train/eval/predict), FSDP
    collectives (all steps of this config), and `grads` (the gradients of the last training step)."""
    p2p = set()
    for (mode, _), (_, stages) in strategy.runner._runtimes.items():
        for stage in stages:
            for kind, infos in (("act", stage.args_recv_info), ("grad", stage.grad_recv_info)):
                for recv in infos.values():
                    for r in recv:
                        if getattr(r, "buffer", None) is not None:
                            p2p.add((mode, stage.stage_index, kind, str(r.buffer.dtype)))
    return {"p2p": sorted(p2p), "fsdp": sorted(COMM_DTYPES), "grads": grads}


def run(cfg: dict, devices: int, out: Path) -> None:
    if int(os.environ.get("LOCAL_RANK", 0)) == cfg.get("late_rank"):  # this process starts late (before any group)
        time.sleep(cfg["late_s"])
    torch.compiler.reset()  # compile=True: each config compiles its layers anew (counted in its step_stats)
    strategy = BFPPStrategy(
        pipeline_parallel=cfg.get("pp", 1), loops=cfg.get("loops", 1), micro_batches=cfg.get("m"),
        schedule=cfg.get("schedule", "breadth_first"), groups=cfg.get("groups", 1),
        sharding=cfg.get("sharding", "full"), reshard_after_forward=cfg.get("reshard", False),
        nonfinite_loss=cfg.get("nonfinite", "stop"), activation_checkpointing=cfg.get("ac", False),
        compile=cfg.get("compile", False),
        stage_layers=cfg.get("stage_layers"),
        timeout=timedelta(seconds=cfg.get("timeout", 120)),
        measure_every_n_steps=1,  # step_stats of every step, as the memory tests were calibrated (steps are few)
        on_signal=cfg.get("on_signal", "save"), signal_grace_s=cfg.get("grace"),
        async_save=cfg.get("async_save", False), cross_step_overlap=cfg.get("cross_step", False),
        shard_unit=cfg.get("shard_unit", "stage"),
    )
    record = Record(cfg.get("trace", False), cfg.get("fail_rank"), cfg)
    callbacks = [record]
    if cfg.get("timeline_trace"):  # the last step's Chrome trace and picture (PipelineTrace) in OUT_DIR/traces
        callbacks.append(PipelineTrace(out / "traces", count=1, skip=cfg.get("steps", 3) - 1))
    if cfg.get("save_every"):
        callbacks.append(ModelCheckpoint(dirpath=cfg["save_dir"], filename="{step}",
                                         every_n_train_steps=cfg["save_every"], save_top_k=-1))
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=cfg.get("steps", 3),
        precision=cfg.get("precision", PRECISION),
        accumulate_grad_batches=cfg.get("accumulate", 1), gradient_clip_val=cfg.get("clip"), logger=False,
        enable_checkpointing=bool(cfg.get("save_every")), enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=2 if cfg.get("eval") or cfg.get("eval_ckpt") else 0, val_check_interval=2,
        callbacks=callbacks,
        default_root_dir=cfg.get("root", out),  # never the caller's directory: a save on a signal may land there
    )
    torch.manual_seed(0)
    kinds = {"configure_model": LateStackNet}  # meta="configure_model": layers built there, on the meta device
    # meta=True: on the meta device, each rank builds its stages (otherwise built in fp32 and cast by the precision
    # plugin: init_module would build a bf16-true model in bf16, drawing other initial weights)
    with trainer.init_module(empty_init=True) if cfg.get("meta") is True else contextlib.nullcontext():
        model = kinds.get(cfg.get("meta"), StackNet)(opt=cfg.get("opt", "sgd"), tied=cfg.get("tied", False),
                                                      counter=cfg.get("counter", False),
                                                      counted=cfg.get("counted", False))
    dp = devices // cfg.get("pp", 1)
    per_replica = cfg.get("batch", 16) // dp
    evaluated = {}
    COMM_DTYPES.clear()
    if cfg.get("eval_ckpt"):  # evaluate a checkpoint file in this layout, no training
        evaluated["val_loss"] = trainer.validate(model, loader(per_replica), ckpt_path=cfg["eval_ckpt"],
                                                 verbose=False)[0]["val_loss"]
    else:
        counted = cfg.get("counted", False)  # about 40 % of the targets ignored, the loss counting the others
        quota = limited(Path(cfg["save_dir"]), cfg["disk_quota"]) if cfg.get("disk_quota") else contextlib.nullcontext()
        with quota:
            trainer.fit(model, train_dataloaders=loader(per_replica, counted),
                        val_dataloaders=loader(per_replica, counted), ckpt_path=cfg.get("resume"))
    if cfg.get("save"):
        trainer.save_checkpoint(cfg["save"])
    if cfg.get("eval"):  # forward-only pipelines after training: validate, test, predict
        evaluated["val_loss"] = trainer.validate(model, loader(per_replica), verbose=False)[0]["val_loss"]
        evaluated["test_loss"] = trainer.test(model, loader(per_replica), verbose=False)[0]["test_loss"]
        evaluated["predictions"] = torch.cat(trainer.predict(model, loader(per_replica)))
    params = {n: _full(p) for n, p in model.named_parameters()}
    local = {n: tuple((p.to_local() if hasattr(p, "to_local") else p).shape) for n, p in model.named_parameters()}
    pipeline_rank = strategy.device_mesh["pipeline_parallel"].get_local_rank()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"params": params, "buffers": {n: b.detach().clone() for n, b in model.named_buffers()}, "local_shapes": local,
         "losses": record.losses, "skipped": record.skipped, "tied_history": record.tied_history,
         "stats": strategy.step_stats, "fsdp_trace": record.events,
         "traces": [str(p) for c in callbacks if isinstance(c, PipelineTrace) for p in c.written],
         "prefetches": strategy.runner.prefetches,
         "dtypes": _dtypes(strategy, record.grad_dtypes),
         **evaluated, "cluster_env": type(trainer.strategy.cluster_environment).__name__,
         "schedule_fsdp": [(a.op.value, a.stage) for a in strategy.schedule.fsdp_actions(pipeline_rank)],
         "units": record.units, "arriving": record.arriving,
         "stage_layers": {s: len(m.layer_modules()) for s, m in strategy.runner.modules.items()}},
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    from launch import run_configs

    # a test may ask a process that outlives its budget where it is
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    _record_fsdp_comm_dtypes()
    run_configs(run)
