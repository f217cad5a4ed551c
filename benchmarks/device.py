"""One prepared run for a machine lent for a few minutes (one GPU, 16 CPU cores): `benchmarks/device.sh`.

    benchmarks/device.sh --out device.json          # the real run: fits 8 minutes by construction
    benchmarks/device.sh --dry-run --out dry.json   # the same script on CPU with a tiny model, under 2 minutes

Parts, each in its own process under its own time budget (past it the part is stopped and what it measured so far
is kept, marked "stopped at budget"):
  cpu  processes pinned one per core (BFPP_BENCH_PIN=1): P2's bubble per schedule (pp=2), P4 (pp=2 and pp=4 vs
       one process) and bfpp ÷ torch's own schedule classes (benchmarks/p2_bubble.py, p4_scaling.py,
       torch_schedules.py) — what two processes sharing two cores could not settle.
  gpu  one device in bf16 on a ~0.3B-parameter GPT: per-layer forward/backward times at each micro-batch size;
       bfpp pipeline_parallel=1 at loops 1 and 4 x micro-batches 1, 4 and 8 against a plain PyTorch loop over the
       same micro-batches (gpu.raw_loop) and Lightning's own FSDP2 route (ModelParallelStrategy + fully_shard per
       layer), same model and batch, eager and compiled: step-time ratios and MFU; the simulator's step time for
       each bfpp variant from the layer times measured at its micro-batch size, beside the measured one.
  big  (issue 53; not in the default parts: --parts big) one device in bf16 on a 1.2B-parameter GPT whose
       micro-batches keep an H200 busy (24 x 2048, 1,024 tokens, 16 sequences a step: 2 per micro-batch at m=8): a
       plain PyTorch loop and bfpp pipeline_parallel=1 at m = 1, 4, 8, eager, compiled, and bfpp with
       cuda_graphs=True (each stage's forward and backward replayed as CUDA graphs, one per micro-batch): MFU and
       bfpp / the plain loop at the same m. Its dry run (CPU, tiny model) checks that cuda_graphs=True is refused on
       CPU, naming the setting, and records the message.
Writes one JSON (--out) and prints a short table. Without a GPU the gpu and big parts record why they did not run
(the dry run runs them on CPU in fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (examples/ and tests/ on sys.path)
from common import ROOT

BUDGET_S = {"cpu": 230, "gpu": 200}  # + start-up and the table: under 8 minutes in all
DRY_BUDGET_S = {"cpu": 70, "gpu": 45}  # under 2 minutes in all
BIG_BUDGET_S, BIG_DRY_BUDGET_S = 330, 60  # the big part alone (--parts big): a device call of its own
BIG_MODEL = {"n_layer": 24, "n_head": 16, "n_embd": 2048, "block_size": 1024, "vocab_size": 256}  # 1.2B parameters
GPU_MODEL = {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024, "vocab_size": 256}  # 0.3B parameters
TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 256}


def _save(path: Path, results: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)  # a part stopped at its budget leaves its last complete write


def cpu_part(dry: bool, partial: Path, work: Path) -> None:
    import p2_bubble
    import p4_scaling
    import torch_schedules

    os.environ["BFPP_BENCH_PIN"] = "1"
    size = {"model": "gpt_tiny" if dry else "gpt_small", "batch": 16}
    timed = {"rounds": 1 if dry else 3, "steps": 4 if dry else 7, "warmup": 1 if dry else 2}
    results: dict = {"cores": os.cpu_count(), "pinned": "one core per process"}
    results["p2"] = p2_bubble.run(work / "p2", **size, **timed)
    _save(partial, results)
    results["p4_pp2"] = p4_scaling.run(work / "p4_pp2", **size, **timed, pp=2, loops=2, micro_batches=4)
    _save(partial, results)
    results["torch_schedules"] = torch_schedules.run(work / "torch", **size, **timed)
    _save(partial, results)
    if not dry:
        results["p4_pp4"] = p4_scaling.run(work / "p4_pp4", **size, **timed, pp=4, loops=1, micro_batches=8)
        _save(partial, results)


def measured_cluster(rows: list[dict], cfg: dict, micro_batch: int, device_type: str):
    """One device of `conf/cluster/gpu_8.yaml` (cpu_2.yaml on CPU) whose layer times are the measured `rows` (one
    micro-batch of `micro_batch` samples)."""
    import yaml

    from lightning_bfpp.sim import Cluster

    cluster = yaml.safe_load(
        (ROOT / "conf" / "cluster" / ("gpu_8.yaml" if device_type == "cuda" else "cpu_2.yaml")).read_text())
    blocks = [r for r in rows if r["layer"].startswith("blocks.")]
    pair = lambda r: [r["forward_ms"] / 1e3, r["backward_ms"] / 1e3]  # noqa: E731
    cluster["layer_times"] = {"model": {k: cfg[k] for k in ("n_head", "n_embd", "block_size", "vocab_size")},
                              "micro_batch_size": micro_batch, "embedding": pair(rows[0]), "head": pair(rows[-1]),
                              "block": [statistics.median(pair(r)[i] for r in blocks) for i in (0, 1)]}
    return Cluster.from_dict({**cluster, "devices": 1, "num_nodes": 1})


def predicted_step_s(cluster, cfg: dict, micro_batch: int, batch: int, loops: int, device_type: str) -> float:
    """The simulator's step time of bfpp pp=1 (`loops`, batch / micro_batch micro-batches) on `cluster`."""
    from lightning_bfpp.schedule import ScheduleSpec, build_schedule
    from lightning_bfpp.sim import Model, build_costs, evaluate

    m = batch // micro_batch
    costs = build_costs(Model.from_dict(cfg), cluster, pipeline_parallel=1, loops=loops,
                        data_parallel=1, micro_batch_size=micro_batch, micro_batches=m,
                        activation_bytes=2 if device_type == "cuda" else 4)
    spec = ScheduleSpec("breadth_first", pipeline_parallel=1, loops=loops, micro_batches=m)
    return evaluate(build_schedule(spec), costs).step_time


def gpu_part(dry: bool, partial: Path, work: Path) -> None:
    import torch
    from gpt import GPTConfig
    from gpu import layer_table, one_stage_run, peak_tflops, raw_loop

    cuda = torch.cuda.is_available()
    if not cuda and not dry:
        _save(partial, {"skipped": "no CUDA device on this machine (the dry run runs this part on CPU)"})
        return
    device = torch.device("cuda" if cuda else "cpu")
    cfg_dict = TINY_MODEL if dry else GPU_MODEL
    cfg, batch, steps = GPTConfig(**cfg_dict), 8, 5 if dry else 10
    peak = peak_tflops(device, None)
    results: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "model": cfg_dict,
                     "batch": batch, "precision": "bf16-mixed" if cuda else "32-true", "peak_tflops": peak,
                     "variants": {}, "layers": {}}
    micro_batches = (1, 4, 8)
    clusters = {}  # the simulator's device for each micro-batch size, from layer times measured at that size
    for m in micro_batches:
        rows = results["layers"][str(batch // m)] = layer_table(cfg, batch // m, device, reps=3 if dry else 10)
        clusters[m] = measured_cluster(rows, cfg_dict, batch // m, device.type)
        _save(partial, results)
    variants = [("raw", 1, m) for m in micro_batches] + [("fsdp2", 1, 1)]
    variants += [("bfpp", loops, m) for loops in (1, 4) for m in micro_batches]
    to_compile = [v for v in variants if not dry or v in (("raw", 1, 1), ("fsdp2", 1, 1), ("bfpp", 1, 1))]
    modes = [(False, v) for v in variants] + [(True, v) for v in to_compile]
    for compiled, (strategy, loops, m) in modes:
        suffix = " compiled" if compiled else ""
        name = _variant(strategy, loops, m) + suffix
        if strategy == "raw":
            run = raw_loop(cfg, batch, m, steps, device, compiled)
        else:
            run = one_stage_run(cfg, batch, m, steps, device, loops=loops, compiled=compiled, strategy=strategy)
        run["mfu"] = run["model_flops_per_s"] / (peak * 1e12) if peak else None
        if strategy == "bfpp":
            for base in ("raw", "fsdp2"):  # the plain PyTorch loop at the same micro-batches, and Lightning's FSDP2
                ref = results["variants"].get(_variant(base, 1, m) + suffix)
                run[f"step_s_over_{base}"] = run["step_s"] / ref["step_s"] if ref else None
            run["simulated_step_s"] = predicted_step_s(clusters[m], cfg_dict, batch // m, batch, loops, device.type)
            run["simulated_over_measured"] = run["simulated_step_s"] / run["step_s"]
        results["variants"][name] = run
        _save(partial, results)


def big_part(dry: bool, partial: Path, work: Path) -> None:
    """A compute-bound model: the plain loop and bfpp pp=1 at m = 1, 4, 8, eager, compiled and with CUDA graphs."""
    import torch
    from gpt import GPTConfig
    from gpu import one_stage_run, peak_tflops, raw_loop

    cuda = torch.cuda.is_available()
    if not cuda and not dry:
        _save(partial, {"skipped": "no CUDA device on this machine (the dry run runs this part on CPU)"})
        return
    device = torch.device("cuda" if cuda else "cpu")
    cfg_dict = TINY_MODEL if dry else BIG_MODEL
    cfg, batch, steps = GPTConfig(**cfg_dict), 8 if dry else 16, 5 if dry else 7
    peak = peak_tflops(device, None)
    results: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "model": cfg_dict,
                     "batch": batch, "precision": "bf16-mixed" if cuda else "32-true", "peak_tflops": peak,
                     "variants": {}}
    modes = [("eager", False, False), ("cuda_graphs", False, True), ("compiled", True, False)]  # compiles: last
    for mode, compiled, graphs in modes:
        for m in (1, 4, 8):
            for kind in ("raw", "bfpp") if not graphs else ("bfpp",):
                name = f"{kind} m={m} {mode}"
                if graphs and not cuda:  # what can run without a GPU: the refusal, named
                    try:
                        one_stage_run(cfg, batch, m, 1, device, cuda_graphs=True)
                        results["variants"][name] = {"error": "cuda_graphs=True ran on CPU"}
                    except ValueError as error:
                        results["variants"][name] = {"refused_on_cpu": str(error)}
                    _save(partial, results)
                    continue
                run = (raw_loop(cfg, batch, m, steps, device, compiled) if kind == "raw" else
                       one_stage_run(cfg, batch, m, steps, device, compiled=compiled, cuda_graphs=graphs))
                run["mfu"] = run["model_flops_per_s"] / (peak * 1e12) if peak else None
                raw = results["variants"].get(f"raw m={m} {'eager' if graphs else mode}")
                if kind == "bfpp" and raw:
                    run["step_s_over_raw"] = run["step_s"] / raw["step_s"]
                results["variants"][name] = run
                _save(partial, results)


def _variant(strategy: str, loops: int, m: int) -> str:
    """A gpu-part variant's name (without " compiled"); Lightning's FSDP2 runs one micro-batch only."""
    return {"bfpp": f"bfpp loops={loops} m={m}", "raw": f"raw m={m}", "fsdp2": "fsdp2"}[strategy]


PARTS = {"cpu": cpu_part, "gpu": gpu_part, "big": big_part}


def run_part(name: str, dry: bool, budget: float, work: Path) -> dict:
    """The part in its own process group, stopped at `budget` seconds; what it saved so far, with its status."""
    partial = work / f"{name}.json"
    cmd = [sys.executable, __file__, "--part", name, "--partial", str(partial), "--work", str(work / name)]
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd + (["--dry-run"] if dry else []), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=budget)
            status = "ok" if rc == 0 else f"failed (exit {rc}; log {work / f'{name}.log'})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and every process it launched
            proc.wait()
            status = f"stopped at budget ({budget:.0f} s)"
    results = json.loads(partial.read_text()) if partial.exists() else {}
    return {"status": status, "seconds": round(time.perf_counter() - t0, 1), "budget_s": budget, **results}


def table(report: dict) -> str:
    lines = [f"device.sh{' --dry-run' if report['dry_run'] else ''}: {report['elapsed_s']} s"]
    cpu = report["parts"].get("cpu", {})
    if cpu:
        lines.append(f"cpu: {cpu['status']}")
    for label, row in (cpu.get("p2") or {}).get("schedules", {}).items():
        lines.append(f"  P2 {label:<14} bubble {row['measured']['median']:.3f} (formula {row['theory']:.3f})")
    for key in ("p4_pp2", "p4_pp4"):
        if key in cpu:
            lines.append(f"  P4 {key[3:]} / one process: {cpu[key]['speedup']['median']:.3f}")
    for cls, row in (cpu.get("torch_schedules") or {}).get("schedules", {}).items():
        lines.append(f"  bfpp / {cls}: {row['ratio']['median']:.3f}")
    gpu = report["parts"].get("gpu", {})
    if gpu:
        lines.append(f"gpu: {gpu['status']} {gpu.get('skipped', gpu.get('device', ''))}")
    for name, run in (gpu.get("variants") or {}).items():
        raw, fsdp2 = run.get("step_s_over_raw"), run.get("step_s_over_fsdp2")
        mfu, sim = run.get("mfu"), run.get("simulated_over_measured")
        lines.append(f"  {name:<26} step {run['step_s'] * 1e3:9.2f} ms" + (f"  / raw {raw:.3f}" if raw else "")
                     + (f"  / fsdp2 {fsdp2:.3f}" if fsdp2 else "") + (f"  MFU {mfu:.1%}" if mfu else "")
                     + (f"  sim/measured {sim:.2f}" if sim else ""))
    big = report["parts"].get("big", {})
    if big:
        lines.append(f"big: {big['status']} {big.get('skipped', big.get('device', ''))}")
    for name, run in (big.get("variants") or {}).items():
        if "step_s" not in run:
            lines.append(f"  {name:<26} {run}")
            continue
        raw, mfu = run.get("step_s_over_raw"), run.get("mfu")
        lines.append(f"  {name:<26} step {run['step_s'] * 1e3:9.2f} ms" + (f"  / raw {raw:.3f}" if raw else "")
                     + (f"  MFU {mfu:.1%}" if mfu else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, short budgets: checks the script")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "device.json")
    ap.add_argument("--parts", default="cpu,gpu")
    ap.add_argument("--budget-scale", type=float, default=1.0,
                    help="multiply every part's budget (a test on a loaded machine checks the code paths, not the "
                         "time)")
    ap.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # the child process of one part
    ap.add_argument("--partial", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, default=None, help="where logs and launch files go (default: a temp dir)")
    args = ap.parse_args()
    if args.part:
        args.work.mkdir(parents=True, exist_ok=True)
        PARTS[args.part](args.dry_run, args.partial, args.work)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="bfpp-device-"))
    work.mkdir(parents=True, exist_ok=True)
    big = BIG_DRY_BUDGET_S if args.dry_run else BIG_BUDGET_S
    budgets = {**(DRY_BUDGET_S if args.dry_run else BUDGET_S), "big": big}
    budgets = {k: v * args.budget_scale for k, v in budgets.items()}
    t0 = time.perf_counter()
    report = {"dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M"), "work": str(work),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "parts": {}}
    for name in args.parts.split(","):
        print(f"device.sh: part {name} (budget {budgets[name]:.0f} s)", flush=True)
        report["parts"][name] = run_part(name, args.dry_run, budgets[name], work)
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
