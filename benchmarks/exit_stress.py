"""How often a finished job fails at exit: the app launched again and again, each run counted by exit status and
by "terminate called" (a C++ thread still joinable when the interpreter ends: SIGABRT, exit -6 / 134).

    .venv/bin/python benchmarks/exit_stress.py [--runs 50] [--launchers lightning torchrun] [--hog | --no-hog]

Each run: `python examples/train.py` (Lightning's launcher) or `torchrun --nproc-per-node=2 examples/train.py` with
cluster=cpu_2, pp=2, 3 steps, no logger; with --hog (default) a busy-looping process runs beside it, as a loaded CI
machine does. Prints one line per run that failed (its code and the last lines it printed) and a count per launcher.
Not part of `make bench` (minutes per 10 runs).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import common  # noqa: E402,F401  (puts examples/ and tests/ on sys.path)
from common import clean_env  # noqa: E402
from procenv import free_port  # noqa: E402

ARGS = ["cluster=cpu_2", "schedule.pipeline_parallel=2", "schedule.loops=1", "schedule.micro_batches=2",
        "trainer.max_steps=3", "trainer.limit_val_batches=1", "trainer.val_check_interval=3", "logger=none",
        "trainer.enable_progress_bar=false", "data.max_bytes=200000", "checkpoint.last=false"]


def command(launcher: str, run_dir: Path) -> list[str]:
    train = [str(ROOT / "examples" / "train.py"), *ARGS, f"hydra.run.dir={run_dir}"]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}", *train]
    return [sys.executable, *train]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--launchers", nargs="+", default=["lightning", "torchrun"], choices=["lightning", "torchrun"])
    parser.add_argument("--hog", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.hog else None
    try:
        for launcher in args.launchers:
            failed = aborted = 0
            times = []
            for i in range(args.runs):
                with tempfile.TemporaryDirectory(prefix="bfpp-exit-stress-") as tmp:
                    start = time.monotonic()
                    p = subprocess.run(command(launcher, Path(tmp) / "run"), cwd=tmp, env=clean_env(),
                                       capture_output=True, text=True, timeout=600)
                    times.append(time.monotonic() - start)
                out = p.stdout + p.stderr
                abort = "terminate called" in out
                failed += p.returncode != 0
                aborted += abort
                if p.returncode != 0 or abort:
                    tail = " | ".join(out.strip().splitlines()[-4:])
                    print(f"{launcher} run {i + 1}: exit {p.returncode}{', terminate called' if abort else ''}: {tail}",
                          flush=True)
            print(f"== {launcher}{' + CPU hog' if hog else ''}: {failed} of {args.runs} runs exited non-zero, "
                  f"{aborted} printed 'terminate called'; {min(times):.1f}-{max(times):.1f} s per run", flush=True)
    finally:
        if hog is not None:
            hog.kill()


if __name__ == "__main__":
    main()
