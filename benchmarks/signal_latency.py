"""How fast a job goes down after SIGTERM / SIGINT to the launching process or to a child rank, and what it says.

    .venv/bin/python benchmarks/signal_latency.py [--launchers lightning torchrun] [--targets launcher child]
                                                  [--signals SIGTERM SIGINT] [--repeats 3] [--on-signal save|exit]

Uses tests/test_signals.py's job (tests/run_exact.py: StackNet, pp=2 on 2 processes, a checkpoint every step).
Prints, per signal, the seconds until every process (ranks and launcher/agent) is gone, the job's exit status,
the newest checkpoint step (checked complete and equal to the reference) and the distinct reasons the ranks printed.
With --on-signal save (the strategy's default) every rank first saves last.ckpt at the agreed step (a step is 0.2 s
plus the work): the time includes up to two steps and that save.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import common  # noqa: E402,F401  (puts examples/ and tests/ on sys.path)
from test_signals import STOPPED, newest_checkpoint_is_complete, signal_job  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launchers", nargs="+", default=["lightning", "torchrun"], choices=["lightning", "torchrun"])
    parser.add_argument("--targets", nargs="+", default=["launcher", "child"], choices=["launcher", "child"])
    parser.add_argument("--signals", nargs="+", default=["SIGTERM", "SIGINT"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--on-signal", choices=["save", "exit"], default="exit")
    args = parser.parse_args()
    for launcher in args.launchers:
        for target in args.targets:
            for name in args.signals:
                times = []
                for i in range(args.repeats):
                    work = Path(tempfile.mkdtemp(prefix=f"bfpp-{launcher}-{target}-{name}-"))
                    try:
                        stopped = signal_job(work, launcher, target, signal.Signals[name], on_signal=args.on_signal)
                        step = newest_checkpoint_is_complete(stopped.save_dir, work)
                    finally:
                        shutil.rmtree(work, ignore_errors=True)
                    times.append(stopped.gone_s)
                    reasons = sorted({why for _, why in STOPPED.findall(stopped.output)})
                    print(f"{name} to {target} ({launcher}, try {i + 1}): every process gone after "
                          f"{stopped.gone_s:.1f} s, exit {stopped.codes}, newest checkpoint step={step} complete; "
                          f"reasons printed: {reasons}",
                          flush=True)
                print(f"== {name} to {target} ({launcher}, on_signal={args.on_signal}): "
                      f"{min(times):.1f}-{max(times):.1f} s over {len(times)} tries",
                      flush=True)


if __name__ == "__main__":
    main()
