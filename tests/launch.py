"""Run a worker script (tests/run_*.py) in fresh processes, and cache each launch's records per test module.

A worker script trains several configs one after another in the same processes: `script OUT_DIR DEVICES
CONFIGS_JSON`, rank R of config i writing OUT_DIR/cfg{i}/rank{R}.pt (`run_configs` is its entry point). Three
launchers start it: Lightning's own (`run_lightning`: this process is rank 0 and starts the others), torchrun
(`run_torchrun`), and SLURM's variables on one process per rank (`run_slurm`). `Launches` is a module's lazy cache:
each key's launch is made the first time a test asks for its records, once per module (one launch at a time: more
processes at once crawl on a few cores), so a selection of tests launches only what it reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import procenv
import torch
from procenv import free_port

if TYPE_CHECKING:
    import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "run_exact.py"

Configs = list[dict] | dict[str, dict]  # a dict names its configs: the records are then found by name
Launcher = Callable[..., list[list[dict]]]  # (out, devices, configs, timeout=, script=) -> [config][rank] records


def run_configs(run: Callable[[dict, int, Path], None]) -> None:
    """A worker script's entry point: `script OUT_DIR DEVICES CONFIGS_JSON` calls `run(cfg, devices, OUT_DIR/cfg<i>)`
    for each config, one after the other in the same processes."""
    out, devices, configs = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    for i, cfg in enumerate(configs):
        run(cfg, devices, out / f"cfg{i}")


def clean_env(**extra: str) -> dict[str, str]:
    """procenv.clean_env with one intra-op thread per process and unbuffered output, plus `extra`."""
    return procenv.clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def load(out: Path, n_configs: int, world: int) -> list[list[dict]]:
    """Every config's per-rank records: [config][rank]."""
    return [[torch.load(out / f"cfg{i}" / f"rank{r}.pt", weights_only=False) for r in range(world)]
            for i in range(n_configs)]


def merged(ranks: list[dict], key: str = "params") -> dict[str, torch.Tensor]:
    """The whole model's `key` tensors ("params", "buffers") from its ranks' records, each rank holding its own
    stages' (a name several ranks hold, e.g. a tied weight's copies, from the last of them)."""
    return {name: t for r in ranks for name, t in r[key].items()}


def _args(script: Path, out: Path, devices: int, configs: list[dict]) -> list[str]:
    return [str(script), str(out), str(devices), json.dumps(configs)]


def _popen(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every process's output once all have exited (all killed after `timeout` seconds, as subprocess.run does)."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise


def _check(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for the processes the launch started (``wait_all``); raise, with their errors and the end of their output,
    if one failed."""
    outputs = wait_all(procs, timeout)
    for p, out in zip(procs, outputs):
        if p.returncode:
            errors = "\n".join(line for line in out.splitlines() if "Error:" in line or "Exception:" in line)
            raise AssertionError(f"launch failed (exit {p.returncode}); errors:\n{errors}\n--- tail:\n{out[-6000:]}")


def start_lightning(out: Path, devices: int, configs: list[dict], script: Path = SCRIPT,
                    prefix: Sequence[str] = ()) -> subprocess.Popen:
    """Lightning's own launcher: this process is rank 0 and starts ranks 1.. itself (output: one pipe). `prefix`: a
    command the launch runs under (e.g. setpriv)."""
    return _popen([*prefix, sys.executable, *_args(script, out, devices, configs)],
                  clean_env(MASTER_PORT=str(free_port())))


def start_torchrun(out: Path, devices: int, configs: list[dict], script: Path = SCRIPT,
                   prefix: Sequence[str] = ()) -> subprocess.Popen:
    """torchrun starts every rank (output: one pipe). `prefix`: a command the launch runs under (e.g. setpriv)."""
    cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={devices}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", *_args(script, out, devices, configs)]
    return _popen(cmd, clean_env())


def start_slurm(out: Path, devices: int, configs: list[dict], script: Path = SCRIPT,
                **extra: str) -> list[subprocess.Popen]:
    """What `srun --ntasks=N` does on one node: N processes, each told its task id by SLURM variables (job 4242);
    `extra`: more environment variables for every task."""
    port = str(free_port())
    return [_popen([sys.executable, *_args(script, out, devices, configs)], clean_env(
        SLURM_NTASKS=str(devices), SLURM_NTASKS_PER_NODE=str(devices), SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="bfpp-test", SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra))
        for rank in range(devices)]


def run_lightning(out: Path, devices: int, configs: list[dict], timeout: float = 480,
                  script: Path = SCRIPT) -> list[list[dict]]:
    """`configs` trained in one launch by Lightning's launcher; every config's per-rank records."""
    _check([start_lightning(out, devices, configs, script)], timeout)
    return load(out, len(configs), devices)


def run_torchrun(out: Path, devices: int, configs: list[dict], timeout: float = 300,
                 script: Path = SCRIPT) -> list[list[dict]]:
    """`configs` trained in one launch by torchrun; every config's per-rank records."""
    _check([start_torchrun(out, devices, configs, script)], timeout)
    return load(out, len(configs), devices)


def run_slurm(out: Path, devices: int, configs: list[dict], timeout: float = 300,
              script: Path = SCRIPT) -> list[list[dict]]:
    """`configs` trained in one launch of one process per rank with SLURM's variables; every config's records."""
    _check(start_slurm(out, devices, configs, script), timeout)
    return load(out, len(configs), devices)


@dataclass(frozen=True)
class Launch:
    """One launch: its output folder, and each config's per-rank records; `launch[config]` (its name, or its index)
    -> [rank 0's record, rank 1's, ...]."""

    out: Path
    records: dict[Hashable, list[dict]]

    def __getitem__(self, config: Hashable) -> list[dict]:
        return self.records[config]


class Launches:
    """A test module's launches, each made the first time a test asks for it: `runs(key)` -> Launch.

    `plan(key, out)` gives the launch's process count and its configs (it may write inputs into `out`, the launch's
    own folder, and name files there in the configs)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, plan: Callable[[Hashable, Path], tuple[int, Configs]],
                 script: Path = SCRIPT, timeout: float = 480, launcher: Launcher = run_lightning) -> None:
        self.tmp_path_factory, self.plan, self.script, self.timeout, self.launcher = (
            tmp_path_factory, plan, script, timeout, launcher)
        self.done: dict[Hashable, Launch] = {}

    def __call__(self, key: Hashable) -> Launch:
        if key not in self.done:
            out = self.tmp_path_factory.mktemp(f"{self.script.stem}-{key}")
            devices, configs = self.plan(key, out)
            names = list(configs) if isinstance(configs, dict) else range(len(configs))
            listed = list(configs.values()) if isinstance(configs, dict) else configs
            records = self.launcher(out, devices, listed, timeout=self.timeout, script=self.script)
            self.done[key] = Launch(out, dict(zip(names, records, strict=True)))
        return self.done[key]
