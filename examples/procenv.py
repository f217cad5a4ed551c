"""Starting fresh distributed processes from a script, a test or a benchmark: a free local port
and an environment without the variables of whatever launcher started the caller (tests, benchmarks and
examples/calibrate.py start worker processes)."""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

# Set by Lightning's popen launcher (also in the parent afterwards), torchrun, SLURM, or W&B.
LAUNCHER_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                 "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED")
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "WANDB_")
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, drawn below the kernel's ephemeral range: the
    ports there are what every outgoing connection on the machine takes its local port from, so one of those (a
    store client of another test's job) could hold it by the time the job's store binds it (seen: EADDRINUSE)."""
    low = _ephemeral_low()
    draw = random.Random()  # seeded from the OS, whatever the caller seeded
    for _ in range(100):
        port = draw.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that part of the range is busy: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768 by default); IANA's
    49152 elsewhere."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment minus launcher variables, with the repository and examples/ first on PYTHONPATH
    (a worker imports the example's modules by their names, `gpt`, `data`, as the scripts in examples/ do), then
    this process's own PYTHONPATH entries."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    own = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(ROOT), str(ROOT / "examples"), *own])), **extra}


def runqueue_wait() -> float:
    """Seconds this thread has waited for a CPU so far (Linux schedstat; 0 where unavailable): the time
    other processes took from it, to tell a clean timing from one disturbed by a shared machine."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return 0.0
