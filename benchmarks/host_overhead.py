"""Host cost of a bfpp step against a plain PyTorch loop over the same micro-batches (issue 53), in one process.

A model small enough that the host, not arithmetic, sets the step time: 16 x (LayerNorm, Linear 64, GELU), 16 rows
per step, SGD, OMP_NUM_THREADS=1. Each round runs, for every (m, loops), side by side and in rotated order:
  plain      a plain PyTorch loop: each micro-batch's forward, loss / m and backward, then the optimizer step
  stages     the least a pipeline runtime does more: the same loop cut into bfpp's `loops` stages, in breadth-first
             order, each stage's backward of each micro-batch its own autograd call (inputs detached between stages)
  torch      torch's own pipelining runtime (``_PipelineScheduleRuntime``) executing the same lowered actions as bfpp
             over the same stages, the same optimizer loop around it (no Lightning, no bfpp)
  lightning  plain Lightning (strategy "auto") whose training_step runs the same micro-batches (one backward) and
             logs the loss, as bfpp logs it
  bfpp       Trainer(strategy=BFPPStrategy(pipeline_parallel=1, loops, micro_batches=m)), defaults otherwise
A step is measured from its batch's start to the next batch's start (data loading and the loop's bookkeeping
included, for every variant). Time (default): the median step of each run after warm-up, each ratio taken per round
and printed as the median over rounds with its range. ``--callgrind``: the same runs under valgrind's callgrind,
counting the instructions of the measured steps (instrumentation on only for them), which other processes on the
machine do not change; one round is enough. "host us / action" is (bfpp - plain) per step / (forward and backward
passes per step: 2 x loops x m); in callgrind mode the extra instructions per action.

    python benchmarks/host_overhead.py                         # 5 rounds, m in {1, 8}, loops in {1, 4}
    python benchmarks/host_overhead.py --rounds 3 --only bfpp  # bfpp against the plain loop only
    python benchmarks/host_overhead.py --callgrind             # instructions per step (needs valgrind and gcc)
    python benchmarks/host_overhead.py --profile m1l1.prof     # cProfile bfpp's runs at m=1, loops=1 instead
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool (the premise of this figure)

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from itertools import cycle
from pathlib import Path

import common  # noqa: F401  (puts the repository on sys.path)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lightning_bfpp import BFPPStrategy, PipelineHooks

WIDTH, DEPTH, ROWS, LR = 64, 16, 16, 0.01
VARIANTS = ("plain", "stages", "torch", "lightning", "bfpp")
CALLGRIND_ENV = "BFPP_HOST_OVERHEAD_CALLGRIND"  # set in the process valgrind runs: its output folder


class Net(PipelineHooks, LightningModule):
    """16 x (LayerNorm, Linear, GELU): a Lightning user's module with bfpp's two hooks."""

    def __init__(self, micro_batches: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU())
                                    for _ in range(DEPTH))
        self.micro_batches = micro_batches  # for strategy "auto": training_step runs them itself

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, output, target):
        return F.mse_loss(output, target)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):  # strategy "auto" only: bfpp runs the pipeline instead
        x, y = batch
        m = self.micro_batches
        loss = sum(self.pipeline_loss(self(a), b) for a, b in zip(x.chunk(m), y.chunk(m))) / m
        self.log("train_loss", loss, prog_bar=True)  # as a Lightning user logs it (and bfpp logs it for the user)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def loader(steps: int) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(ROWS * steps, WIDTH, generator=gen),
                                          torch.randn(ROWS * steps, WIDTH, generator=gen))
    return torch.utils.data.DataLoader(data, batch_size=ROWS)


class Meter:
    """Marks each step's start; measures steps [warmup, warmup + count): their median time in seconds, or (under
    callgrind) their instructions per step. A run takes warmup + count + 1 steps (the last one ends the window)."""

    def __init__(self, warmup: int, count: int, callgrind: Callgrind | None) -> None:
        self.warmup, self.count, self.callgrind = warmup, count, callgrind
        self.marks: list[float] = []

    @property
    def steps(self) -> int:
        return self.warmup + self.count + 1

    def mark(self) -> None:
        i = len(self.marks)
        if self.callgrind is not None and i == self.warmup + self.count:
            self.callgrind.stop()
        self.marks.append(time.perf_counter())
        if self.callgrind is not None and i == self.warmup:
            self.callgrind.start()

    def value(self) -> float:
        if self.callgrind is not None:
            return self.callgrind.read() / self.count
        times = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return statistics.median(times[self.warmup:self.warmup + self.count])


class MarkSteps(Callback):
    def __init__(self, meter: Meter) -> None:
        self.meter = meter

    def on_train_batch_start(self, *args) -> None:
        self.meter.mark()


def run_plain(m: int, loops: int, meter: Meter) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in loader(meter.steps):
        meter.mark()
        for a, b in zip(x.chunk(m), y.chunk(m)):
            (model.pipeline_loss(model(a), b) / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def run_stages(m: int, loops: int, meter: Meter) -> None:
    """Breadth-first over `loops` stages by hand: forward stage by stage for every micro-batch, then backward stage by
    stage in reverse, each (stage, micro-batch) backward one autograd call on its output."""
    torch.manual_seed(0)
    model = Net()
    per = DEPTH // loops
    stages = [model.layers[i * per:(i + 1) * per] for i in range(loops)]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in loader(meter.steps):
        meter.mark()
        inputs, outputs = {}, {}
        for s, stage in enumerate(stages):
            for k, chunk in enumerate(x.chunk(m)):
                h = chunk if s == 0 else outputs[(s - 1, k)].detach().requires_grad_()
                inputs[(s, k)] = h
                for layer in stage:
                    h = layer(h)
                outputs[(s, k)] = h
        grads = {}
        for s in reversed(range(loops)):
            for k, target in enumerate(y.chunk(m)):
                out = outputs.pop((s, k))
                if s == loops - 1:
                    (model.pipeline_loss(out, target) / m).backward()
                else:
                    torch.autograd.backward(out, grads.pop((s + 1, k)))
                if s > 0:
                    grads[(s, k)] = inputs.pop((s, k)).grad
        opt.step()
        opt.zero_grad(set_to_none=True)


def run_torch(m: int, loops: int, meter: Meter) -> None:
    """torch's runtime over bfpp's own lowered action list and stage modules, with a plain optimizer loop."""
    from lightning_bfpp._private.pipelining import build_runtime
    from lightning_bfpp.layout.cut import split_stages
    from lightning_bfpp.schedule import ScheduleSpec, build_schedule

    torch.manual_seed(0)
    model = Net()
    spec = ScheduleSpec("breadth_first", pipeline_parallel=1, loops=loops, micro_batches=m)
    modules, _ = split_stages(model, model.pipeline_layers(), spec.num_stages, spec.local_stages(0), spec.stage_rank)
    runtime, _ = build_runtime(build_schedule(spec), modules, torch.device("cpu"), dist.group.WORLD,
                               model.pipeline_loss)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in loader(meter.steps):
        meter.mark()
        runtime.step(x, target=y, losses=[])
        opt.step()
        opt.zero_grad(set_to_none=True)


def run_lightning(m: int, loops: int, meter: Meter, bfpp: bool) -> None:
    torch.manual_seed(0)
    model = Net(micro_batches=m)
    strategy = BFPPStrategy(pipeline_parallel=1, loops=loops, micro_batches=m) if bfpp else "auto"
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=meter.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[MarkSteps(meter)])
    trainer.fit(model, train_dataloaders=loader(meter.steps))


RUNS = {"plain": run_plain, "stages": run_stages, "torch": run_torch,
        "lightning": lambda m, loops, meter: run_lightning(m, loops, meter, bfpp=False),
        "bfpp": lambda m, loops, meter: run_lightning(m, loops, meter, bfpp=True)}


def run(variant: str, m: int, loops: int, warmup: int, count: int, callgrind: Callgrind | None = None) -> float:
    """One run of `variant`: its median step (s), or its instructions per step under callgrind."""
    meter = Meter(warmup, count, callgrind)
    RUNS[variant](m, loops, meter)
    return meter.value()


class Callgrind:
    """Instruction counts of marked regions in a process that valgrind's callgrind runs with instrumentation off
    (``--instr-atstart=no``): a tiny C library issues callgrind's client requests to start instrumenting, then to
    stop and dump the region's counts, which ``read`` takes from the dump file."""

    def __init__(self, folder: Path) -> None:
        import ctypes

        source, lib = folder / "cgtoggle.c", folder / "libcgtoggle.so"
        source.write_text("#include <valgrind/callgrind.h>\n"
                          "void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }\n"
                          "void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(source)], check=True)
        self.lib, self.folder, self.dumps = ctypes.CDLL(str(lib)), folder, 0

    def start(self) -> None:
        self.lib.cg_start()

    def stop(self) -> None:
        self.lib.cg_stop()
        self.dumps += 1

    def read(self) -> float:
        """The instructions of the last region (its dump's totals line)."""
        dump = self.folder / f"callgrind.out.{os.getpid()}.{self.dumps}"
        for line in dump.read_text().splitlines():
            if line.startswith("totals:"):
                return float(line.split()[1])
        raise RuntimeError(f"no totals line in {dump}")


def under_callgrind(argv: list[str]) -> int:
    """Run this script again under callgrind (instrumentation off until the measured steps), in a scratch folder."""
    if shutil.which("valgrind") is None or shutil.which("gcc") is None:
        raise SystemExit("--callgrind needs valgrind and gcc (with valgrind/callgrind.h) on PATH")
    folder = Path(tempfile.mkdtemp(prefix="host_overhead_cg_"))
    out = folder / "callgrind.out.%p"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
           sys.executable, *argv]
    return subprocess.run(cmd, env={**os.environ, CALLGRIND_ENV: str(folder)}).returncode


def world_of_one() -> None:
    """A gloo group of this one process (torch's runtime needs one; bfpp's Trainer then reuses it)."""
    if not dist.is_initialized():
        from procenv import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--micro-batches", default="1,8")
    ap.add_argument("--loops", default="1,4")
    ap.add_argument("--only", default=",".join(VARIANTS), help="variants (plain always runs)")
    ap.add_argument("--callgrind", action="store_true", help="count instructions under valgrind (default rounds: 1)")
    ap.add_argument("--profile", type=Path, help="cProfile bfpp's runs at the first m and loops into this file")
    ap.add_argument("--out", type=Path, help="write the per-round figures here (JSON)")
    args = ap.parse_args()
    if args.callgrind and CALLGRIND_ENV not in os.environ:
        raise SystemExit(under_callgrind(sys.argv))
    callgrind = Callgrind(Path(os.environ[CALLGRIND_ENV])) if args.callgrind else None
    if callgrind is not None and "--rounds" not in sys.argv:
        args.rounds = 1
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    world_of_one()
    variants = ["plain", *[v for v in args.only.split(",") if v != "plain"]]
    settings = [(int(m), int(loops)) for m in args.micro_batches.split(",") for loops in args.loops.split(",")]
    if args.profile:
        import cProfile

        m, loops = settings[0]
        run("bfpp", m, loops, args.warmup, args.steps)  # warm
        with cProfile.Profile() as prof:
            run("bfpp", m, loops, args.warmup, args.steps)
        prof.dump_stats(args.profile)
        print(f"wrote {args.profile} (bfpp, m={m}, loops={loops}, {args.steps} steps)")
        return
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    what = "instructions per step (callgrind)" if callgrind else "step time"
    print(f"host overhead, {what}: {DEPTH} x (LayerNorm, Linear {WIDTH}, GELU), {ROWS} rows, SGD, one process, "
          f"{torch.get_num_threads()} thread; {args.rounds} round(s) x {args.steps} steps ({args.warmup} warm-up); "
          f"load average at start {load:.2f} on {os.cpu_count()} cores", flush=True)
    table: dict[tuple[int, int], dict[str, list[float]]] = {s: {v: [] for v in variants} for s in settings}
    shift = cycle(range(len(variants)))
    for r in range(args.rounds):
        for setting in settings:
            k = next(shift)
            for variant in variants[k:] + variants[:k]:  # rotated: no variant always runs first
                table[setting][variant].append(run(variant, *setting, args.warmup, args.steps, callgrind))
        print(f"  round {r + 1} done", flush=True)
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average at the end {load_end:.2f}")
    _report(table, variants, args.out, (load, load_end), callgrind is not None)


def _report(table: dict, variants: list[str], out: Path | None, load: tuple[float, float], instructions: bool) -> None:
    def ratio(num: list[float], den: list[float]) -> str:
        values = [a / b for a, b in zip(num, den)]
        if len(values) == 1:
            return f"{values[0]:.3f}"
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    unit, scale = ("M instr.", 1e-6) if instructions else ("ms", 1e3)
    extra_unit, extra_scale = ("k instr.", 1e-3) if instructions else ("us", 1e6)
    has_bfpp = "bfpp" in variants
    header = f"| m | loops | plain ({unit}) | " + " | ".join(f"{v} / plain" for v in variants[1:])
    if has_bfpp:
        header += f" | bfpp / lightning | bfpp - plain per step ({extra_unit}) | per action ({extra_unit})"
    print(header + " |")
    print("|---" * header.count(" | ") + "|---|")
    rows = []
    for (m, loops), runs in table.items():
        plain = runs["plain"]
        line = f"| {m} | {loops} | {scale * statistics.median(plain):.3f} | " + " | ".join(
            ratio(runs[v], plain) for v in variants[1:])
        extra = {}
        if has_bfpp:
            extra_per_step = statistics.median([b - p for b, p in zip(runs["bfpp"], plain)])
            actions = 2 * loops * m
            versus = ratio(runs["bfpp"], runs["lightning"]) if "lightning" in runs else "-"
            line += f" | {versus} | {extra_scale * extra_per_step:.0f} | {extra_scale * extra_per_step / actions:.1f}"
            extra = {"bfpp_extra_per_step": extra_per_step, "actions": actions}
        print(line + " |")
        rows.append({"m": m, "loops": loops, "per_step": runs, **extra})
    if out is not None:
        unit = "instructions" if instructions else "seconds"
        out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "load_average": load, "unit": unit,
                                   "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
