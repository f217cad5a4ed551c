"""What every benchmark shares — launching benchmarks/worker.py in clean processes, reading
the per-rank result files back, model presets from conf/model/, and median/spread statistics."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The benchmarks are scripts run by path (benchmarks/ first on sys.path): the package (installed or not: a bare
# checkout on a lent GPU machine), the example's modules (procenv, gpt, data) and the test launch helpers are imported
# by name, as under pytest (pyproject: pythonpath). The workers get the same through procenv.clean_env's PYTHONPATH.
sys.path[1:1] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]
import procenv  # noqa: E402
from procenv import free_port  # noqa: E402

WORKER = ROOT / "benchmarks" / "worker.py"


def clean_env() -> dict[str, str]:
    """No inherited launcher variables; one intra-op thread per process (the benchmarks' premise)."""
    return procenv.clean_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")


def launch(out: Path, devices: int, jobs: list[dict], timeout: float = 600) -> list[dict]:
    """Run `jobs` in order in one launch of `devices` processes (Lightning's popen launcher starts the
    other ranks). Returns, per job, {"rank0": {...}, "rank1": {...}, ...} as the ranks wrote them."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "jobs.json").write_text(json.dumps(jobs, indent=1))
    env = clean_env()
    env["MASTER_PORT"] = str(free_port())
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(WORKER), str(out), str(devices)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    (out / "log.txt").write_text(proc.stdout)
    if proc.returncode:
        raise RuntimeError(f"benchmark launch in {out} failed (exit {proc.returncode}):\n{proc.stdout[-5000:]}")
    results = []
    for i in range(len(jobs)):
        job_dir = out / f"job{i}"
        results.append({p.stem: json.loads(p.read_text()) for p in sorted(job_dir.glob("rank*.json"))})
    print(f"  launch of {devices} process(es), {len(jobs)} job(s): {time.perf_counter() - t0:.1f} s", flush=True)
    return results


def model_config(name: str) -> dict:
    """conf/model/<name>.yaml as a plain dict of GPTConfig fields (one source of truth for sizes)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"))
    cfg.pop("name", None)
    return cfg


def summarize(values: list[float]) -> dict:
    """Median and spread of repeated measurements: min, max and the relative half-range."""
    values = [float(v) for v in values]
    med = statistics.median(values)
    lo, hi = min(values), max(values)
    return {"median": med, "min": lo, "max": hi, "n": len(values),
            "rel_spread": (hi - lo) / 2 / abs(med) if med else 0.0}


def fmt(stat: dict, digits: int = 3) -> str:
    """'1.023 (0.998–1.041, n=5)' for tables."""
    return f"{stat['median']:.{digits}f} ({stat['min']:.{digits}f}–{stat['max']:.{digits}f}, n={stat['n']})"


def rotate(items: list, shift: int) -> list:
    """Interleaving: round i runs the variants in an order rotated by i, so no variant always goes first."""
    shift %= len(items)
    return items[shift:] + items[:shift]
