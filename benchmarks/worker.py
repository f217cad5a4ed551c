"""One benchmark launch: run a list of jobs in order in the same processes, each rank writing its results.

Usage (the benchmark modules call it through benchmarks/common.py:launch):
    python benchmarks/worker.py OUT_DIR DEVICES        # reads OUT_DIR/jobs.json

Job kinds (each a dict with "kind", "model" (conf/model name), "batch" (global), "steps", ...):
  bfpp    Trainer(strategy=BFPPStrategy(pp, loops, m, schedule, sharding, measure_every_n_steps=measure,
          cross_step_overlap=cross_step));
          "grad_sync": "per_parameter" replaces sharding="none"'s bucketed reduction by the earlier per-parameter one
  raw     the same stages and micro-batches under torch.distributed.pipelining's public schedule class
          (ScheduleLoopedBFS / ScheduleInterleaved1F1B / ScheduleGPipe / Schedule1F1B) and a plain
          AdamW + LambdaLR loop — what a torch user writes by hand
  mp      Trainer(strategy=ModelParallelStrategy()) + fully_shard per layer: Lightning's FSDP2 route
          (Lightning 2.6 refuses strategy="fsdp", FSDP1, without a GPU)
  single  Trainer(devices=1): the plain model, no parallelism
Optional job keys: "compile" (bfpp: BFPPStrategy(compile=True); the others: each pipeline layer compiled).
A "model" may be a dict of GPTConfig fields instead of a conf/model name. BFPP_BENCH_PIN=1 pins each rank to its
own core (LOCAL_RANK modulo the cores), as `taskset` would.
Rank R of job i writes OUT_DIR/job{i}/rank{R}.json with per-step "step_s" (on_train_batch_start ->
on_train_batch_end: training_step, backward, optimizer step) and "period_s" (batch start -> next batch
start: also data loading and the loop's bookkeeping), bfpp's per-step stats, and memory counts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer

ROOT = Path(__file__).resolve().parent.parent
from common import model_config  # noqa: E402  (started with procenv.clean_env: examples/ is on PYTHONPATH)
from data import ByteWindows, load_corpus, split_corpus  # noqa: E402
from gpt import GPT, GPTConfig, OptimConfig, lr_factor  # noqa: E402

from lightning_bfpp import BFPPStrategy, mean_loss  # noqa: E402
from lightning_bfpp.runtime.instrument import SavedActivationMeter, local_bytes, optimizer_bytes  # noqa: E402

_CORPUS: dict[int, ByteWindows] = {}


def dataset(block_size: int) -> ByteWindows:
    if block_size not in _CORPUS:
        train, _ = split_corpus(load_corpus(2_000_000), 0.05)
        _CORPUS[block_size] = ByteWindows(train, block_size)
    return _CORPUS[block_size]


def loader(block_size: int, batch: int) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1234)
    return torch.utils.data.DataLoader(dataset(block_size), batch_size=batch, shuffle=True, generator=gen,
                                       drop_last=True)


def memory_of(params, optimizers) -> dict:
    params = list(params)
    return {"param_bytes": local_bytes(params), "grad_bytes": local_bytes(p.grad for p in params),
            "optimizer_bytes": optimizer_bytes(optimizers)}


class Probe(Callback):
    """Per-step wall times; bfpp's step_stats; memory of the local shards. For the non-bfpp baselines
    the saved activations of the LAST step are counted (untimed), the way bfpp's own meter counts them."""

    def __init__(self, count_activations: bool):
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.stats: list[dict] = []
        self.memory: dict = {}
        self.count_activations = count_activations
        self._meter: SavedActivationMeter | None = None
        self._tracking = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())
        if self.count_activations and trainer.global_step == trainer.max_steps - 1:
            self._meter = SavedActivationMeter([pl_module])  # the meter bfpp's own runtime uses
            self._tracking = self._meter.track(exclude=[t for t in batch if isinstance(t, torch.Tensor)])
            self._tracking.__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        if self._tracking is not None:  # the forward is over: the peak of saved tensors is reached
            self._tracking.__exit__(None, None, None)
            self.memory["activation_peak_bytes"] = self._meter.peak
            self._meter = self._tracking = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.memory.update(memory_of((p for p in pl_module.parameters() if p.requires_grad), []))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())
        stats = dict(getattr(trainer.strategy, "step_stats", None) or {})
        if stats:
            memory = stats.pop("memory")  # this rank's counts, or every rank's as {global rank: {...}}
            if all(isinstance(v, dict) for v in memory.values()):
                memory = memory[trainer.global_rank]
            self.memory = dict(memory)
            self.stats.append(stats)
        else:
            self.memory["optimizer_bytes"] = optimizer_bytes(o for o in trainer.optimizers)

    def result(self) -> dict:
        return {"step_s": [e - s for s, e in zip(self.starts, self.ends)],
                "period_s": [b - a for a, b in zip(self.starts, self.starts[1:])],
                "stats": self.stats, "memory": self.memory}


class PerParameterGradSync(Callback):
    """For comparison (job "grad_sync": "per_parameter"): sharding="none" as before the bucketed reduction - one
    blocking all-reduce per parameter after the whole schedule, no overlap with backward."""

    def on_train_start(self, trainer, pl_module):
        runner = trainer.strategy.runner
        if runner.grad_sync is None:
            return
        runner.grad_sync, group, inner = None, runner.replicate_group, runner.train_step

        def train_step(*args, **kwargs):
            out = inner(*args, **kwargs)
            for mod in runner.modules.values():
                for p in mod.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=group)
                        p.grad.div_(dist.get_world_size(group))
            return out

        runner.train_step = train_step


def strategy_for(job: dict):
    kind = job["kind"]
    if kind == "bfpp":
        return BFPPStrategy(pipeline_parallel=job["pp"], loops=job.get("loops", 1), micro_batches=job["m"],
                            schedule=job.get("schedule", "breadth_first"), sharding=job.get("sharding", "full"),
                            measure_every_n_steps=job.get("measure"), stage_layers=job.get("stage_layers"),
                            compile=job.get("compile", False), cross_step_overlap=job.get("cross_step", False))
    if kind == "mp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=job["devices"], tensor_parallel_size=1)
    return "auto"


class ShardedGPT(GPT):
    """The example GPT as a ModelParallelStrategy user writes it: fully_shard each layer (FSDP2)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.pipeline_layers():
            fully_shard(layer, mesh=mesh)


def gpt_config(model: str | dict) -> GPTConfig:
    return GPTConfig(**(model_config(model) if isinstance(model, str) else model))


def compile_each_layer(model: GPT) -> None:
    """As a Lightning user compiles outside bfpp (and torchtitan does): each pipeline layer, before FSDP wraps it."""
    for layer in model.pipeline_layers():
        layer.compile()


def run_lightning(job: dict, devices: int) -> dict:
    torch.manual_seed(0)
    cfg = gpt_config(job["model"])
    model = (ShardedGPT if job["kind"] == "mp" else GPT)(cfg, OptimConfig())
    if job.get("compile") and job["kind"] != "bfpp":  # bfpp compiles its own (BFPPStrategy(compile=True))
        compile_each_layer(model)
    pp = job.get("pp", 1) if job["kind"] == "bfpp" else 1
    per_replica = job["batch"] // (devices // pp)
    probe = Probe(count_activations=job["kind"] != "bfpp")
    job = {**job, "devices": devices}
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy_for(job), max_steps=job["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[probe] + ([PerParameterGradSync()] if job.get("grad_sync") == "per_parameter" else []),
    )
    trainer.fit(model, train_dataloaders=loader(cfg.block_size, per_replica))
    return probe.result()


def _torch_schedule(job: dict, stages, loss_fn):
    from torch.distributed.pipelining import schedules as S

    name, m = job.get("schedule", "breadth_first"), job["m"]
    if name == "breadth_first":
        return S.ScheduleLoopedBFS(stages, m, loss_fn=loss_fn)
    if name == "depth_first":
        return S.ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    cls = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B}[name]
    return cls(stages[0], m, loss_fn=loss_fn)


def run_raw(job: dict, devices: int) -> dict:
    """The same cut, schedule and optimizer as the bfpp job, as a plain torch.distributed.pipelining loop."""
    from torch.distributed.pipelining import PipelineStage

    from lightning_bfpp.layout.cut import split_stages
    from lightning_bfpp.schedule import ScheduleSpec

    assert devices == job["pp"], "the raw loop is pipeline-only (data_parallel = 1)"
    torch.manual_seed(0)
    cfg, optim = gpt_config(job["model"]), OptimConfig()
    model = GPT(cfg, optim)
    spec = ScheduleSpec(job.get("schedule", "breadth_first"), pipeline_parallel=job["pp"], loops=job.get("loops", 1),
                        micro_batches=job["m"])
    rank = dist.get_rank()
    modules, _ = split_stages(model, model.pipeline_layers(), spec.num_stages, spec.local_stages(rank), spec.stage_rank)
    stages = [PipelineStage(mod, s, spec.num_stages, torch.device("cpu")) for s, mod in sorted(modules.items())]
    schedule = _torch_schedule(job, stages, lambda output, target: mean_loss(model.pipeline_loss(output, target)))
    params = [p for mod in modules.values() for p in mod.parameters()]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_factor(step, optim.warmup_steps, job["steps"], optim.min_lr_ratio))
    first, last = 0 in modules, spec.num_stages - 1 in modules
    starts, ends, it = [], [], iter(loader(cfg.block_size, job["batch"]))
    for _ in range(job["steps"]):
        starts.append(time.perf_counter())
        x, y = next(it)
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        schedule.step(*args, target=y if last else None, losses=losses if last else None)
        opt.step()
        memory = memory_of(params, [opt])
        opt.zero_grad(set_to_none=True)
        sched.step()
        ends.append(time.perf_counter())
    starts.append(time.perf_counter())
    return {"step_s": [e - s for s, e in zip(starts, ends)], "period_s": [b - a for a, b in zip(starts, starts[1:])],
            "stats": [], "memory": memory}


def ensure_launched(devices: int) -> None:
    """Lightning's popen launcher starts the other ranks at the first fit: run a 1-step fit so that a
    raw job can come first, and imports/thread pools are warm for every job."""
    if devices > 1 and not (dist.is_available() and dist.is_initialized()):
        run_lightning({"kind": "bfpp", "model": "gpt_tiny", "batch": 2 * devices, "steps": 1, "pp": devices,
                       "m": devices, "schedule": "gpipe"}, devices)


def pin_to_own_core() -> None:
    """BFPP_BENCH_PIN=1: this process (local rank r) runs on core r alone (modulo the cores it may use)."""
    if os.environ.get("BFPP_BENCH_PIN") != "1" or not hasattr(os, "sched_setaffinity"):
        return
    # the cores the launch may use, read by rank 0 before it pins itself (the ranks it starts inherit its affinity)
    os.environ.setdefault("BFPP_BENCH_CORES", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    cores = [int(c) for c in os.environ["BFPP_BENCH_CORES"].split(",")]
    os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", 0)) % len(cores)]})


def main() -> None:
    out, devices = Path(sys.argv[1]), int(sys.argv[2])
    pin_to_own_core()
    jobs = json.loads((out / "jobs.json").read_text())
    torch.set_num_threads(1)
    ensure_launched(devices)
    for i, job in enumerate(jobs):
        if devices > 1:
            dist.barrier()  # every job starts together on all ranks
        rank = dist.get_rank() if devices > 1 else 0
        run = run_raw if job["kind"] == "raw" else run_lightning
        if os.environ.get("BFPP_BENCH_PROFILE"):  # cProfile each job: OUT_DIR/job{i}/rank{R}.prof
            import cProfile

            (out / f"job{i}").mkdir(parents=True, exist_ok=True)
            with cProfile.Profile() as prof:
                result = run(job, devices)
            prof.dump_stats(out / f"job{i}" / f"rank{rank}.prof")
        else:
            result = run(job, devices)
        (out / f"job{i}").mkdir(parents=True, exist_ok=True)
        (out / f"job{i}" / f"rank{rank}.json").write_text(json.dumps({"job": job, **result}))


if __name__ == "__main__":
    main()
