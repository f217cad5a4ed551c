"""Where one device's step time goes (not part of `make bench`; the question `benchmarks/device.sh` raised):
the same GPT and batch as device.py's gpu part, stepped by a plain PyTorch loop (no Lightning, no bfpp), by
bfpp pipeline_parallel=1 and (one micro-batch) by Lightning's FSDP2, with 1 and 8 micro-batches, eager and with each
layer compiled. For each: the step time and, from torch.profiler over one more step, the time the GPU spent in
kernels, and the kernels and host ops that cost most. A step much longer than its kernels is bound by the host
(launches, Python), not by the GPU. BENCHMARKS.md, "The first device run", has what it found.

    PY=python3 python benchmarks/device_profile.py --out prof.json            # on the GPU machine
    python benchmarks/device_profile.py --dry-run                             # CPU, tiny model: checks the script
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import common  # noqa: F401  (puts the repository and examples/ on sys.path)
import torch
from device import GPU_MODEL, TINY_MODEL
from gpt import GPTConfig
from gpu import one_stage_run, raw_loop
from lightning.pytorch import Callback


def _activities() -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def _summary(prof, wall_s: float) -> dict:
    """Kernel time, launches, the kernels and the host ops that cost most, of one profiled step."""
    events = prof.key_averages()
    host_names = {e.key for e in events if e.device_type.name == "CPU"}
    # device rows named like a host op are record_function ranges drawn on the GPU ("PP:0F0", "Optimizer.step"),
    # spans over kernels counted already (and over the gaps between them): not kernels
    kernels = [e for e in events if e.device_type.name == "CUDA" and e.key not in host_names]
    top = lambda rows, key: {e.key[:60]: round(key(e) / 1e3, 2) for e in sorted(rows, key=key, reverse=True)[:8]}  # noqa: E731
    return {"profiled_wall_ms": 1e3 * wall_s, "kernel_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
            "kernels": sum(e.count for e in kernels),
            "top_kernels_ms": top(kernels, lambda e: e.self_device_time_total),
            "top_host_ops_ms": top(events, lambda e: e.self_cpu_time_total)}


class Profiled:
    """torch.profiler over a region, the device synchronized at both ends; `result`: its `_summary`."""

    def __enter__(self) -> Profiled:
        from torch.profiler import profile

        self._prof, self.result = profile(activities=_activities()), {}
        _sync()
        self._t0 = time.perf_counter()
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        _sync()
        self._prof.__exit__(*exc)
        self.result = _summary(self._prof, time.perf_counter() - self._t0)


def _profile(step) -> dict:
    with Profiled() as region:
        step()
    return region.result


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class ProfileOneStep(Callback):
    """`Profiled` over training step `at` of a Lightning run."""

    def __init__(self, at: int):
        self.at, self.result, self._region = at, {}, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            self._region = Profiled().__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._region is not None:
            self._region.__exit__(None, None, None)
            self.result, self._region = self._region.result, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--micro-batches", default="1,8", help="comma-separated")
    ap.add_argument("--modes", default="eager,compiled", help="eager and/or compiled")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    cfg, batch, steps = GPTConfig(**(TINY_MODEL if args.dry_run else GPU_MODEL)), 8, 5 if args.dry_run else 8
    rows: dict[str, dict] = {}
    for compiled in [mode == "compiled" for mode in args.modes.split(",")]:
        for m in [int(v) for v in args.micro_batches.split(",")]:
            tag = f"m={m}" + (" compiled" if compiled else "")
            print(f"raw {tag}", flush=True)
            rows[f"raw {tag}"] = raw_loop(cfg, batch, m, steps, device, compiled, profile=_profile)
            for strategy in ("bfpp", "fsdp2") if m == 1 else ("bfpp",):  # Lightning's FSDP2 has no micro-batches
                print(f"{strategy} {tag}", flush=True)
                probe = ProfileOneStep(at=steps)  # the last step: its period is not among the timed ones
                run = one_stage_run(cfg, batch, m, steps + 1, device, compiled=compiled, callbacks=[probe],
                                    strategy=strategy)
                rows[f"{strategy} {tag}"] = {"step_s": run["step_s"], **probe.result, **run.get("compiled", {})}
            _save(args.out, rows)
    for name, r in rows.items():
        kernels = r.get("kernel_ms", 0.0)
        print(f"{name:<20} step {1e3 * r['step_s']:8.2f} ms  kernels {kernels:8.2f} ms "
              f"({kernels / (1e3 * r['step_s']):.0%} of the step)")
        for what in ("top_kernels_ms", "top_host_ops_ms"):
            print(f"    {what}:", ", ".join(f"{k} {v}" for k, v in list(r.get(what, {}).items())[:6]))


def _save(out: Path | None, rows: dict) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
