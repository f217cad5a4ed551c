"""Auto_layout_ratio — throughput of BFPPStrategy(layout="auto")'s pick ÷ the best of a grid of hand-set layouts
(pp in {1, 2}, loops in {1, 2, 4}, m in {2, 4, 8}, every legal schedule; sharding full) at one global batch, in one
launch of 2 processes; each round runs every layout and auto in rotated order (auto measures and decides anew in
every round). Only steady-state step periods count (auto's measurement at setup is reported apart: startup_s).

layout="auto" against hand-set layouts (BENCHMARKS.md "Automatic layout").

    python benchmarks/auto_layout.py --quick                 # 12 layouts x 2 rounds, 5 steps (~4 min on 2 busy cores)
    python benchmarks/auto_layout.py --rounds 5              # the full grid, 8 steps (~60 layouts: ~40 min per round)
    python benchmarks/run_all.py --only auto [--quick-auto]  # the same, merged into benchmarks/results/summary.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, clean_env, free_port, model_config, rotate, summarize

SCHEDULES = ("breadth_first", "depth_first", "gpipe", "1f1b")


def grid(world: int, batch: int, num_layers: int, quick: bool = False) -> list[dict]:
    """Every legal hand-set layout (``ParallelDims.validate``: world, stages vs layers, the batch split)."""
    from lightning_bfpp.dims import ParallelDims
    from lightning_bfpp.schedule import ScheduleError, ScheduleSpec

    pps, loops, ms = ((1, 2), (1, 2), (2, 4)) if quick else ((1, 2), (1, 2, 4), (2, 4, 8))
    schedules = ("breadth_first", "1f1b") if quick else SCHEDULES
    out = []
    for pp in pps:
        for lp in loops:
            for m in ms:
                for name in schedules:
                    spec = ScheduleSpec(name, pipeline_parallel=pp, loops=lp, micro_batches=m)
                    try:
                        ParallelDims(world=world, spec=spec).validate(num_layers=num_layers, global_batch=batch)
                    except (ScheduleError, ValueError):
                        continue
                    out.append({"pp": pp, "loops": lp, "m": m, "schedule": name,
                                "label": f"{name} pp={pp} loops={lp} m={m}"})
    return out


def run(out: Path, *, model: str, batch: int, rounds: int, steps: int, warmup: int, quick: bool = False,
        devices: int = 2) -> dict:
    cfg = model_config(model)
    hand = [{**v, "model": model, "batch": batch, "steps": steps}
            for v in grid(devices, batch, cfg["n_layer"] + 2, quick)]
    auto = {"auto": True, "model": model, "batch": batch, "steps": steps, "label": "auto"}
    jobs = [job for i in range(rounds) for job in rotate(hand + [auto], i)]
    results = _launch(out, devices, jobs)
    speed: dict[str, list[float]] = {}  # samples/s per round, per layout
    picks, startup = [], []
    for job, res in zip(jobs, results):
        periods = res["rank0"]["period_s"][warmup : steps - 1]
        speed.setdefault(job["label"], []).append(batch / statistics.median(periods))
        if job.get("auto"):
            picks.append(res["rank0"]["layout"])
            startup.append(res["rank0"]["startup_s"])
            assert all(r["layout"] == res["rank0"]["layout"] for r in res.values()), "ranks picked different layouts"
    hand_labels = [k for k in speed if k != "auto"]
    best = max(hand_labels, key=lambda k: statistics.median(speed[k]))
    per_round_max = [max(speed[k][i] for k in hand_labels) for i in range(rounds)]
    # The best median of many near-tied noisy layouts is biased upward (a max over noise). Held out: in each round,
    # the hand-set layout that is best over the OTHER rounds, timed in this round (leave-one-out selection).
    held_out = [max(hand_labels, key=lambda k: statistics.median(speed[k][:i] + speed[k][i + 1:]))
                for i in range(rounds)] if rounds > 1 else []
    hand_startup = [r["rank0"]["startup_s"] for j, r in zip(jobs, results) if not j.get("auto")]
    return {"setting": {"model": model, "batch": batch, "rounds": rounds, "steps": steps, "warmup": warmup,
                        "processes": devices, "threads_per_process": 1, "grid_size": len(hand), "quick": quick,
                        "timed": "step period (batch start -> next batch start), steps warmup..steps-2"},
            "ratio": summarize([a / b for a, b in zip(speed["auto"], speed[best])]),  # auto ÷ best-median layout
            "ratio_vs_round_max": summarize([a / b for a, b in zip(speed["auto"], per_round_max)]),
            "ratio_held_out": summarize([speed["auto"][i] / speed[k][i] for i, k in enumerate(held_out)])
            if rounds > 1 else None,
            "held_out_layouts": held_out,
            "best_hand_layout": best, "auto_picks": picks,
            "startup_s": {"auto": summarize(startup), "hand": summarize(hand_startup)},
            "samples_per_s": {k: summarize(v)
                              for k, v in sorted(speed.items(), key=lambda kv: -statistics.median(kv[1]))},
            "samples_per_s_per_round": speed}


def _launch(out: Path, devices: int, jobs: list[dict], timeout: float = 7200) -> list[dict]:
    """One launch of this file as the worker (Lightning's popen launcher starts the other ranks)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "jobs.json").write_text(json.dumps(jobs, indent=1))
    env = {**clean_env(), "MASTER_PORT": str(free_port())}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", str(out), str(devices)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    (out / "log.txt").write_text(proc.stdout)
    if proc.returncode:
        raise RuntimeError(f"auto-layout launch in {out} failed (exit {proc.returncode}):\n{proc.stdout[-5000:]}")
    print(f"  launch of {devices} processes, {len(jobs)} jobs: {time.perf_counter() - t0:.1f} s", flush=True)
    return [{p.stem: json.loads(p.read_text()) for p in sorted((out / f"job{i}").glob("rank*.json"))}
            for i in range(len(jobs))]


def _fit(job: dict, devices: int) -> dict:
    """One job: the example GPT under a hand-set or automatic layout, every replica loading batch / data_parallel."""
    import lightning.pytorch as pl
    import torch
    import worker as w  # benchmarks/worker.py: the corpus, the Probe callback
    from gpt import GPT, GPTConfig, OptimConfig

    from lightning_bfpp import BFPPStrategy
    from lightning_bfpp.layout.auto import AutoLayout

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(w.dataset(cfg.block_size),
                                               batch_size=self.trainer.strategy.replica_batch_size, shuffle=True,
                                               drop_last=True, generator=torch.Generator().manual_seed(1234))

    torch.manual_seed(0)
    cfg = GPTConfig(**model_config(job["model"]))
    if job.get("auto"):  # layers timed on micro-batches of batch / (2 x processes) samples
        sample = torch.zeros(max(1, job["batch"] // (2 * devices)), cfg.block_size, dtype=torch.long)
        strategy = BFPPStrategy(layout=AutoLayout(sample=sample), global_batch_size=job["batch"])
    else:
        strategy = BFPPStrategy(pipeline_parallel=job["pp"], loops=job["loops"], micro_batches=job["m"],
                                schedule=job["schedule"], global_batch_size=job["batch"],
                                measure_every_n_steps=job.get("measure"))
    probe = w.Probe(count_activations=False)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=job["steps"], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe])
    t0 = time.perf_counter()
    trainer.fit(GPT(cfg, OptimConfig()), datamodule=Data())
    s = trainer.strategy
    layout = {"schedule": s.spec.name, "pipeline_parallel": s.pipeline_parallel, "loops": s.loops,
              "micro_batches": s.micro_batches, "groups": s.spec.groups, "sharding": s.sharding,
              "reshard_after_forward": s.spec.reshard_after_forward, "stage_layers": s.stage_layers}
    return {**probe.result(), "layout": layout, "startup_s": probe.starts[0] - t0}


def _work(out: Path, devices: int) -> None:
    import torch
    import torch.distributed as dist
    import worker as w

    jobs = json.loads((out / "jobs.json").read_text())
    torch.set_num_threads(1)
    w.ensure_launched(devices)
    for i, job in enumerate(jobs):
        dist.barrier()
        result = _fit(job, devices)
        (out / f"job{i}").mkdir(parents=True, exist_ok=True)
        (out / f"job{i}" / f"rank{dist.get_rank()}.json").write_text(json.dumps({"job": job, **result}))


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return _work(Path(sys.argv[2]), int(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="12 layouts (pp 1-2, loops 1-2, m 2-4, breadth_first/1f1b), "
                    "2 rounds, 5 steps")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--batch", type=int, default=16, help="global batch (samples per optimizer step)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bfpp-bench-auto"))
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    steps, warmup = (5, 2) if args.quick else (8, 2)
    result = run(args.work, model=args.model, batch=args.batch, rounds=rounds, steps=steps, warmup=warmup,
                 quick=args.quick)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
