"""Run tests/run_exact.py in fresh processes (Lightning's launcher, torchrun, or SLURM-like env)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import procenv
import torch
from procenv import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "run_exact.py"


def run_configs(run: Callable[[dict, int, Path], None]) -> None:
    """A worker script's entry point: `script OUT_DIR DEVICES CONFIGS_JSON` calls `run(cfg, devices, OUT_DIR/cfg<i>)`
    for each config, one after the other in the same processes."""
    out, devices, configs = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    for i, cfg in enumerate(configs):
        run(cfg, devices, out / f"cfg{i}")


def clean_env(**extra: str) -> dict[str, str]:
    return procenv.clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def load(out: Path, n_configs: int, world: int) -> list[list[dict]]:
    return [[torch.load(out / f"cfg{i}" / f"rank{r}.pt", weights_only=False) for r in range(world)] for i in range(n_configs)]


def _check(procs: list[subprocess.Popen], timeout: float) -> None:
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outputs):
        if p.returncode:
            errors = "\n".join(line for line in out.splitlines() if "Error:" in line or "Exception:" in line)
            raise AssertionError(f"launch failed (exit {p.returncode}); errors:\n{errors}\n--- tail:\n{out[-6000:]}")


def start_lightning(out: Path, devices: int, configs: list[dict]) -> subprocess.Popen:
    """Lightning's own launcher: this process is rank 0 and starts ranks 1.. itself (output: one pipe)."""
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out), str(devices), json.dumps(configs)],
                            env=clean_env(MASTER_PORT=str(free_port())), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run_lightning(out: Path, devices: int, configs: list[dict], timeout: float = 480) -> list[list[dict]]:
    p = start_lightning(out, devices, configs)
    _check([p], timeout)
    return load(out, len(configs), devices)


def run_torchrun(out: Path, devices: int, configs: list[dict], timeout: float = 300) -> list[list[dict]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={devices}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(SCRIPT), str(out), str(devices), json.dumps(configs)]
    p = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _check([p], timeout)
    return load(out, len(configs), devices)


def run_slurm(out: Path, devices: int, configs: list[dict], timeout: float = 300) -> list[list[dict]]:
    """What `srun --ntasks=N` does on one node: N processes, each told its task id by SLURM variables."""
    port = str(free_port())
    procs = []
    for rank in range(devices):
        env = clean_env(
            SLURM_NTASKS=str(devices), SLURM_NTASKS_PER_NODE=str(devices), SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="bfpp-test", SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        )
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(out), str(devices), json.dumps(configs)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    _check(procs, timeout)
    return load(out, len(configs), devices)
