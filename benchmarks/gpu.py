"""Single-device pieces on a GPU (not part of `make bench`): per-layer forward/backward times of the
example GPT and the MFU of a one-stage bfpp run (pipeline_parallel=1) inside Lightning.

    benchmarks/gpu.sh                         # defaults below, bf16 autocast, prints a short table
    benchmarks/gpu.sh --n-layer 24 --n-embd 2048 --batch 8 --peak-tflops 989
    python benchmarks/gpu.py --device cpu --n-layer 2 --n-embd 64 --block 32 --batch 4 --steps 4   # dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
import common  # noqa: E402,F401  (puts examples/ on sys.path)
from gpt import GPT, GPTConfig, flops_per_token  # noqa: E402

from lightning_bfpp import mean_loss  # noqa: E402

# dense bf16 peak FLOP/s per device (vendor datasheets, without sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0}


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


class Clock:
    """Wall time of a region; synchronizes the GPU around it."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self, fn, reps: int) -> float:
        for _ in range(3):  # warm-up (allocator, kernels, autotuning)
            fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / reps


def layer_table(cfg: GPTConfig, batch: int, device: torch.device, reps: int) -> list[dict]:
    """Forward and forward+backward time of each pipeline layer on its real input."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    clock = Clock(device)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=device)
    names = ["embedding", *[f"blocks.{i}" for i in range(cfg.n_layer)], "head"]
    rows, act = [], x
    for name, layer in zip(names, model.pipeline_layers()):
        inp = act.detach().requires_grad_(act.is_floating_point())

        def fwd(layer=layer, inp=inp):  # with autograd recording, as in training
            with autocast:
                return layer(inp)

        def fwd_bwd(layer=layer, inp=inp, name=name):
            with autocast:
                out = layer(inp)
                loss = mean_loss(model.pipeline_loss(out, x)) if name == "head" else out.float().square().mean()
            loss.backward()

        t_f, t_fb = clock(fwd, reps), clock(fwd_bwd, reps)
        params = sum(p.numel() for p in layer.parameters())
        rows.append({"layer": name, "params": params, "forward_ms": 1e3 * t_f, "backward_ms": 1e3 * (t_fb - t_f),
                     "backward_over_forward": (t_fb - t_f) / t_f if t_f else None})
        with torch.no_grad(), autocast:
            act = layer(inp)
    return rows


def raw_loop(cfg: GPTConfig, batch: int, micro_batches: int, steps: int, device: torch.device, compiled: bool,
             profile=None) -> dict:
    """The plain PyTorch step, no Lightning, no bfpp: each micro-batch's forward and backward (bf16 autocast on
    CUDA), then the example's AdamW. Median step period after 3 steps; `profile(step)` (if given) adds its result."""
    from worker import compile_each_layer

    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if compiled:
        compile_each_layer(model)
    opt = torch.optim.AdamW(model.parameters(), lr=model.optim.lr)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), device=device)
    chunks = list(zip(data[:, :-1].chunk(micro_batches), data[:, 1:].chunk(micro_batches)))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        for x, y in chunks:
            with autocast:
                loss = mean_loss(model.pipeline_loss(model(x), y)) / micro_batches
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    periods = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        periods.append(time.perf_counter() - t0)
    period = statistics.median(periods[3:] or periods)
    tokens = batch * cfg.block_size / period
    return {"step_s": period, "tokens_per_s": tokens,
            "model_flops_per_s": tokens * flops_per_token(cfg, model),
            **(profile(step) if profile else {})}


def one_stage_run(cfg: GPTConfig, batch: int, micro_batches: int, steps: int, device: torch.device,
                  loops: int = 1, compiled: bool = False, strategy: str = "bfpp",
                  callbacks: list | None = None, cuda_graphs: bool = False) -> dict:
    """One device, Lightning: BFPPStrategy(pipeline_parallel=1, loops, micro_batches) or, strategy="fsdp2",
    Lightning's ModelParallelStrategy with each layer fully_shard-ed (worker.ShardedGPT); `compiled`: bfpp's
    compile=True, or each layer compiled before FSDP; `callbacks` join the Trainer's. Median step period after 3 steps
    (the compile is in the first); with bfpp's compile, its last step's graph counts (the result's `compiled`);
    `cuda_graphs`: bfpp's cuda_graphs=True (each stage's passes replayed as CUDA graphs)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy
    from worker import Probe, ShardedGPT, compile_each_layer

    from lightning_bfpp import BFPPStrategy

    torch.manual_seed(0)
    model = (ShardedGPT if strategy == "fsdp2" else GPT)(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(cfg, model)  # before the fit: bfpp leaves only this rank's stages in `model`
    if compiled and strategy == "fsdp2":
        compile_each_layer(model)
    data = torch.randint(0, cfg.vocab_size, (batch * steps, cfg.block_size + 1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch)
    probe = Probe(count_activations=False)
    trainer = Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_steps=steps, logger=False,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1) if strategy == "fsdp2" else
        BFPPStrategy(pipeline_parallel=1, loops=loops, micro_batches=micro_batches, compile=compiled,
                     cuda_graphs=cuda_graphs),
        precision="bf16-mixed" if device.type == "cuda" else "32-true", enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe, *(callbacks or [])],
    )
    trainer.fit(model, loader)
    periods = probe.result()["period_s"]
    period = statistics.median(periods[3:] or periods)
    tokens = batch * cfg.block_size / period
    bubbles = [s["bubble_fraction"] for s in probe.stats if "bubble_fraction" in s]
    graphs = {k: v for k, v in (probe.stats[-1] if probe.stats else {}).items() if k.endswith("compiled_graphs")}
    return ({"compiled": graphs} if graphs else {}) | {"params": n_params, "step_s": period, "tokens_per_s": tokens,
            "model_flops_per_s": tokens * fpt,
            "bubble_fraction": statistics.median(bubbles) if bubbles else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16, help="samples per optimizer step")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=10, help="repetitions per layer timing")
    ap.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU (default: by GPU name)")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.sh needs a CUDA device (the CPU suite is `make bench`); try --device cpu for a dry "
                 "run.")
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} block={cfg.block_size}; batch {args.batch}")
    rows = layer_table(cfg, args.batch // args.micro_batches, device, args.reps)
    print(f"\nper layer (micro-batch of {args.batch // args.micro_batches}):")
    print(f"{'layer':<12}{'params':>12}{'fwd ms':>10}{'bwd ms':>10}{'bwd/fwd':>9}")
    for r in rows:
        print(f"{r['layer']:<12}{r['params']:>12,}{r['forward_ms']:>10.3f}{r['backward_ms']:>10.3f}"
              f"{r['backward_over_forward'] or 0:>9.2f}")
    run = one_stage_run(cfg, args.batch, args.micro_batches, args.steps, device)
    peak = peak_tflops(device, args.peak_tflops)
    run["mfu"] = run["model_flops_per_s"] / (peak * 1e12) if peak else None
    print(f"\none-stage bfpp run (pp=1, m={args.micro_batches}, {'bf16-mixed' if device.type == 'cuda' else 'fp32'}):")
    print(f"  step {run['step_s'] * 1e3:.1f} ms, {run['tokens_per_s']:,.0f} tokens/s, "
          f"{run['model_flops_per_s'] / 1e12:.2f} TFLOP/s, MFU "
          + (f"{run['mfu']:.1%} of {peak:.0f} TFLOP/s" if peak else "n/a (pass --peak-tflops)"))
    if args.out:
        args.out.write_text(json.dumps({"device": name, "layers": rows, "one_stage": run}, indent=1))


if __name__ == "__main__":
    main()
