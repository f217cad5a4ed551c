"""How much two processes computing at once slow each other on this machine (no communication, no bfpp).

    .venv/bin/python benchmarks/core_contention.py [--model gpt_small] [--micro-batch 4] [--rounds 5]

Each round times the same work (forward+backward of half the model's blocks on one micro-batch, 8 times, one
thread) in one process alone and in two processes started together, in rotated order, and prints
concurrent ÷ alone per round (median and range). A pp=2 run on a machine with this factor f computes each
stage f× slower than one process would, before any bubble: its speedup over one process is capped near 2 / f.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import common  # noqa: F401  (puts examples/ and tests/ on sys.path)
from common import clean_env, fmt, model_config, rotate, summarize

WORK = """
import json, statistics, sys, time, torch
from gpt import GPT, GPTConfig
torch.set_num_threads(1)
torch.manual_seed(0)
cfg = GPTConfig(**json.loads(sys.argv[1]))
blocks = list(GPT(cfg).blocks)[: max(1, cfg.n_layer // 2)]
x = torch.randn(int(sys.argv[2]), cfg.block_size, cfg.n_embd)
def once():
    for _ in range(8):
        h = x.requires_grad_(True)
        for b in blocks:
            h = b(h)
        h.sum().backward()
once()  # warm-up
while time.time() < float(sys.argv[3]):
    time.sleep(0.001)
times = []
for _ in range(3):
    t = time.perf_counter(); once(); times.append(time.perf_counter() - t)
print(statistics.median(times))
"""


def timed(processes: int, cfg: dict, micro_batch: int) -> float:
    """Median time of the work per process, `processes` started together (the slowest process's)."""
    start_at = time.time() + 6.0  # past every process's import and warm-up
    procs = [subprocess.Popen([sys.executable, "-c", WORK, json.dumps(cfg), str(micro_batch), str(start_at)],
                              env=clean_env(), stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a timing process failed: {[p.returncode for p in procs]}")
    return max(float(o.strip().splitlines()[-1]) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cfg = model_config(args.model)
    ratios = []
    for i in range(args.rounds):
        t = {n: timed(n, cfg, args.micro_batch) for n in rotate([1, 2], i)}
        ratios.append(t[2] / t[1])
        print(f"round {i}: alone {t[1]:.3f} s, two at once {t[2]:.3f} s, ratio {ratios[-1]:.3f}", flush=True)
    print(f"two processes at once ÷ one alone: {fmt(summarize(ratios))}; pp=2 speedup cap ~ "
          f"{2 / statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
