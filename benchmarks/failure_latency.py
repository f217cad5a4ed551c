"""How fast a 4-process job goes down when one rank is SIGKILLed mid-training, and what the others say.

    .venv/bin/python benchmarks/failure_latency.py [--victims 2 0] [--repeats 3]

Uses tests/run_exact.py (StackNet, pp=2 x loops=2 x dp=2, Lightning's launcher: rank 0 starts ranks 1-3).
Prints, per kill, the seconds until every rank's process is gone, the launcher's exit status and the distinct
reasons the ranks printed ("[rank r] bfpp: the job stops because ...").
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import common  # noqa: E402,F401  (puts examples/ and tests/ on sys.path)
from launch import start_lightning  # noqa: E402

from lightning_bfpp.job.liveness import pid_alive  # noqa: E402

WORLD = 4


def kill_once(victim: int, work: Path) -> tuple[float, int, list[str]]:
    pid_dir = work / "pids"
    pid_dir.mkdir(parents=True)
    cfg = {"pp": 2, "loops": 2, "m": 2, "steps": 100000, "step_sleep": 0.02, "pid_dir": str(pid_dir)}
    proc = start_lightning(work / "out", WORLD, [cfg])
    output: dict[str, str] = {}
    reader = threading.Thread(target=lambda: output.update(text=proc.communicate()[0]))
    reader.start()  # drain the shared pipe: a full pipe would block the ranks' own error output
    while len([p for p in pid_dir.glob("rank*") if p.read_text()]) < WORLD:
        time.sleep(0.1)
    time.sleep(1.0)  # well inside training
    pids = {int(p.name[4:]): int(p.read_text()) for p in pid_dir.glob("rank*")}
    os.kill(pids[victim], signal.SIGKILL)
    killed = time.monotonic()
    while any(pid_alive(p) for p in pids.values()):
        time.sleep(0.05)
    gone = time.monotonic() - killed
    reader.join()
    reasons = sorted({why for _, why in re.findall(r"\[rank (\d)\] bfpp: the job stops because (.*)", output["text"])})
    return gone, proc.returncode, reasons


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--victims", type=int, nargs="+", default=[2, 0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for victim in args.victims:
        for i in range(args.repeats):
            work = Path(tempfile.mkdtemp(prefix=f"bfpp-kill{victim}-"))
            gone, code, reasons = kill_once(victim, work)
            shutil.rmtree(work, ignore_errors=True)
            print(f"SIGKILL rank {victim} (try {i + 1}): every process gone after {gone:.1f} s, launcher exit {code}; "
                  f"reasons printed: {reasons}", flush=True)


if __name__ == "__main__":
    main()
