"""Calibrated simulator vs measured CPU step time, per schedule.

    python benchmarks/sim_vs_measured.py                       # calibrate, run the 4 schedules, compare
    python benchmarks/sim_vs_measured.py --cluster conf/cluster/cpu_2_calibrated.yaml   # reuse a calibration

For each schedule the real strategy (BFPPStrategy, examples/gpt.py GPT with conf/model/gpt_small.yaml,
2 CPU processes, gloo, pp=2, dp=1, 1 thread per process) trains `--steps` optimizer steps; the measured
number is the median of `trainer.strategy.step_stats["step_s"]` (wall time of the schedule, max over ranks)
over the steps after `--warmup` whose run-queue wait (time other processes kept a rank off the CPU, from
/proc/thread-self/schedstat) stayed under `--max-wait`. The prediction is
`lightning_bfpp.sim.evaluate(...).step_time` with the calibrated cluster yaml (examples/calibrate.py, run first
unless `--cluster` is given; it rewrites conf/cluster/cpu_2_calibrated.yaml) and fp32 p2p messages.
gpipe and 1f1b are not looped: they run at loops=1; breadth_first and depth_first at loops=2. Both the
calibration and the runs use `--threads` threads per process (OMP_NUM_THREADS and torch.set_num_threads;
1 = what Lightning's launcher picks for 2 processes on 2 cores). Writes benchmarks/results/sim_vs_measured.json
(table, per-step numbers, the calibration used). Takes ~2 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import common  # noqa: E402,F401  (puts examples/ on sys.path)
from procenv import clean_env, free_port, runqueue_wait  # noqa: E402

SCHEDULES = {"breadth_first": 2, "depth_first": 2, "gpipe": 1, "1f1b": 1}  # name -> loops




# ---------------------------------------------------------------- worker (2 processes, Lightning popen launcher)
def _worker(out: Path, configs: list[dict]) -> None:
    import torch
    import yaml
    from gpt import GPT, GPTConfig, OptimConfig
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bfpp import BFPPStrategy

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)

    class Record(Callback):
        def __init__(self):
            self.steps: list[dict] = []

        def on_fit_start(self, trainer, pl_module):
            runner = trainer.strategy.runner
            inner = runner.train_step
            rec = self

            def timed(*args, **kwargs):
                w0, t0 = runqueue_wait(), time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    rec._window = (t0, time.perf_counter())
                    rec._wait = runqueue_wait() - w0

            runner.train_step = timed

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            s = trainer.strategy
            self.steps.append({
                "step_s": float(s.step_stats["step_s"]), "compute_s": float(s.step_stats["compute_s"]),
                "bubble_fraction": float(s.step_stats["bubble_fraction"]),
                "local": dict(s.runner.last_stats), "window": list(self._window), "wait_s": self._wait,
                "events": [list(e) for e in s.runner.timeline.events],
            })

    for i, cfg in enumerate(configs):
        model_cfg = yaml.safe_load((ROOT / "conf" / "model" / f"{cfg['model']}.yaml").read_text())
        gcfg = GPTConfig(**{k: model_cfg[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")})
        torch.manual_seed(0)
        model = GPT(gcfg, OptimConfig())
        batch = cfg["micro_batches"] * cfg["micro_batch_size"]
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, gcfg.vocab_size, (batch * (cfg["steps"] + 1), gcfg.block_size + 1), generator=g)
        data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch, shuffle=False, drop_last=True)
        strategy = BFPPStrategy(pipeline_parallel=cfg["pp"], loops=cfg["loops"], micro_batches=cfg["micro_batches"],
                                schedule=cfg["schedule"], measure_every_n_steps=1)  # step_stats of every step
        record = Record()
        trainer = Trainer(accelerator="cpu", devices=cfg["devices"], strategy=strategy, max_steps=cfg["steps"],
                          precision="32-true", gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                          num_sanity_val_steps=0, callbacks=[record])
        trainer.fit(model, train_dataloaders=data)
        d = out / f"cfg{i}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank{trainer.global_rank}.json").write_text(json.dumps(
            {"config": cfg, "threads": torch.get_num_threads(), "steps": record.steps}))



def run_measured(configs: list[dict], out: Path, threads: int, timeout: float = 900) -> list[list[dict]]:
    """Launch the worker on `devices` processes (Lightning's popen launcher) and load every rank's record."""
    env = clean_env(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out), json.dumps(configs)]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"measured run failed (exit {p.returncode}):\n{p.stdout[-6000:]}")
    devices = configs[0]["devices"]
    return [[json.loads((out / f"cfg{i}" / f"rank{r}.json").read_text()) for r in range(devices)]
            for i in range(len(configs))]


# ---------------------------------------------------------------- comparison
def measured_step(ranks: list[dict], warmup: int, max_wait: float) -> dict:
    """Median step_s over the steps after `warmup` whose run-queue wait stayed under `max_wait` of the step
    on every rank (other processes on the machine did not steal the CPU); all steps if fewer than 3 are."""
    steps = list(zip(*[r["steps"] for r in ranks]))[warmup:]
    rows = [{"step_s": s[0]["step_s"], "compute_s": s[0]["compute_s"],
             "wait": max(x["wait_s"] / max(x["local"]["step_s"], 1e-9) for x in s)} for s in steps]
    clean = [r for r in rows if r["wait"] <= max_wait]
    use = clean if len(clean) >= 3 else rows
    return {"step_s": statistics.median(r["step_s"] for r in use),
            "compute_s": statistics.median(r["compute_s"] for r in use),
            "clean_steps": len(clean), "steps": len(rows),
            "all_steps_median_s": statistics.median(r["step_s"] for r in rows),
            "per_step": [{k: round(v, 5) for k, v in r.items()} for r in rows]}


def predicted_step(cluster_cfg: dict, model_cfg: dict, cfg: dict) -> dict:
    from lightning_bfpp.schedule import ScheduleSpec, build_schedule
    from lightning_bfpp.sim import Cluster, Model, build_costs, evaluate

    costs = build_costs(Model.from_dict(model_cfg), Cluster.from_dict(cluster_cfg), pipeline_parallel=cfg["pp"],
                        loops=cfg["loops"], data_parallel=cfg["devices"] // cfg["pp"],
                        micro_batch_size=cfg["micro_batch_size"], micro_batches=cfg["micro_batches"],
                        activation_bytes=4)  # 32-true run: fp32 activations on the wire
    spec = ScheduleSpec(cfg["schedule"], pipeline_parallel=cfg["pp"], loops=cfg["loops"],
                        micro_batches=cfg["micro_batches"])
    r = evaluate(build_schedule(spec), costs)
    return {"step_s": r.step_time, "compute_s": max(r.busy), "bubble": r.bubble, "pipeline_bubble": r.pipeline_bubble,
            "stage_forward_s": [s.forward for s in costs.stages],
            "stage_backward_s": [s.backward for s in costs.stages]}


def main() -> None:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help="comma-separated subset of " + ",".join(SCHEDULES))
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch (batch = m x this)")
    parser.add_argument("--steps", type=int, default=15, help="optimizer steps per schedule and round")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (shape inference, allocator)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="launches; the schedule order is reversed every other one")
    parser.add_argument("--max-wait", type=float, default=0.1,
                        help="a step counts as clean when no rank waited for a CPU more than this fraction of it")
    parser.add_argument("--cluster", default=None,
                        help="calibrated cluster yaml to use as is (default: calibrate now into "
                             "conf/cluster/cpu_2_calibrated.yaml)")
    parser.add_argument("--threads", type=int, default=1, help="threads per process, in calibration and runs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sim_vs_measured.json"))
    parser.add_argument("--tmp", default="/tmp/bfpp_sim_vs_measured")
    args = parser.parse_args()
    started = time.time()
    load_before = os.getloadavg()
    model_cfg = yaml.safe_load((ROOT / "conf" / "model" / f"{args.model}.yaml").read_text())

    if args.cluster is None:
        from calibrate import calibrate

        cluster_path = ROOT / "conf" / "cluster" / "cpu_2_calibrated.yaml"
        calibrate(args.model, "cpu_2", micro_batch_size=args.micro_batch_size, threads=args.threads, out=cluster_path)
    else:
        cluster_path = Path(args.cluster).resolve()
    cluster_cfg = yaml.safe_load(cluster_path.read_text())

    names = [n for n in args.schedules.split(",") if n]
    configs = [dict(model=args.model, devices=2, pp=2, loops=SCHEDULES[n], micro_batches=args.micro_batches,
                    micro_batch_size=args.micro_batch_size, schedule=n, steps=args.steps) for n in names]
    records: dict[str, list[list[dict]]] = {n: [] for n in names}
    for k in range(args.rounds):
        order = configs if k % 2 == 0 else configs[::-1]
        for cfg, ranks in zip(order, run_measured(order, Path(args.tmp) / f"round{k}", args.threads)):
            records[cfg["schedule"]].append(ranks)

    rows = []
    for cfg in configs:
        pooled = [{"steps": [s for rnd in records[cfg["schedule"]] for s in rnd[r]["steps"][args.warmup:]]}
                  for r in range(cfg["devices"])]
        meas = measured_step(pooled, 0, args.max_wait)
        pred = predicted_step(cluster_cfg, model_cfg, cfg)
        threads = {rnd[r]["threads"] for rnd in records[cfg["schedule"]] for r in range(cfg["devices"])}
        rows.append({"schedule": cfg["schedule"], "pp": cfg["pp"], "loops": cfg["loops"], "dp": 1,
                     "micro_batches": cfg["micro_batches"], "micro_batch_size": cfg["micro_batch_size"],
                     "threads_per_process": sorted(threads), "measured": meas, "predicted": pred,
                     "error": pred["step_s"] / meas["step_s"] - 1})

    print(f"\n{args.model}, 2 CPU processes x {args.threads} thread, pp=2 dp=1, m={args.micro_batches}, micro-batch "
          f"{args.micro_batch_size}; cluster {cluster_path.name}; median step_s over clean steps after warm-up")
    print(f"{'schedule':14s} {'loops':>5s} {'measured s':>11s} {'predicted s':>12s} {'error':>7s} "
          f"{'compute meas':>13s} {'compute pred':>13s} {'clean/steps':>12s}")
    for r in rows:
        m, p = r["measured"], r["predicted"]
        print(f"{r['schedule']:14s} {r['loops']:5d} {m['step_s']:11.4f} {p['step_s']:12.4f} {r['error']:+7.1%} "
              f"{m['compute_s']:13.4f} {p['compute_s']:13.4f} {m['clean_steps']:>6d}/{m['steps']:<5d}")
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error| {worst:.1%} ({'within' if worst <= 0.15 else 'OUTSIDE'} +-15%); {time.time() - started:.0f}s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(["python benchmarks/sim_vs_measured.py", *sys.argv[1:]]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "seconds": round(time.time() - started, 1),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "cluster_file": str(cluster_path.relative_to(ROOT) if ROOT in cluster_path.resolve().parents else cluster_path),
        "cluster": cluster_cfg, "settings": vars(args), "worst_abs_error": worst, "rows": rows,
    }, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(Path(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        main()
