"""What sequence parallel costs and saves: the example GPT at pp=2 x tp=2 with and without sequence parallel, and at
tp=1, side by side in one launch.

    .venv/bin/python benchmarks/sequence_parallel.py [--width 256] [--heads 4] [--seq 256] [--layers 4] [--repeats 3]

One launch of 4 CPU processes (Lightning's launcher) fits the same model (fp32, SGD, the micro-batch the same in every
layout: 2 sequences) in three layouts, the two tp=2 ones alternating `repeats` times:
- tp1: pp=2 x dp=2 (global batch 16);
- tp2: pp=2 x tp=2, whole activations between the split modules and across stages (global batch 8);
- tp2+sp: the same with sequence parallel.
Per layout it prints the median step time (after 2 warm-up steps; the tp=2 ones are the ratio that matters: the
machine is shared), the largest activation message a rank sends (``step_stats["p2p_message_bytes"]``), and the peak
of saved activations per rank (``activation_peak_bytes``, the saved-tensor meter), beside the simulator's estimate for
the same layout (``lightning_bfpp.sim``: Korthikanti et al.'s per-block formula, Megatron's SP) as ratios to tp1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import common  # noqa: F401  (the repository and examples/ on sys.path)
import torch
from gpt import GPT, GPTConfig, OptimConfig
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_bfpp import BFPPStrategy

MICRO, M = 2, 2  # sequences per micro-batch, micro-batches per step and replica
LAYOUTS = {"tp1": dict(tensor_parallel=1), "tp2": dict(tensor_parallel=2),
           "tp2+sp": dict(tensor_parallel=2, sequence_parallel=True)}


class StepTimer(Callback):
    def __init__(self) -> None:
        self.steps: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.steps.append(time.perf_counter() - self._start)


def config(args) -> GPTConfig:
    return GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.seq, vocab_size=256)


def run(name: str, args) -> dict:
    torch.manual_seed(0)
    layout = LAYOUTS[name]
    dp = 4 // (2 * layout["tensor_parallel"])
    tokens = torch.randint(0, 256, (64, args.seq + 1), generator=torch.Generator().manual_seed(0))
    timer = StepTimer()
    strategy = BFPPStrategy(pipeline_parallel=2, micro_batches=M, measure_every_n_steps=1, **layout)
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, callbacks=[timer])
    model = GPT(config(args), OptimConfig(name="sgd", lr=0.01, warmup_steps=0, min_lr_ratio=1.0))
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=MICRO * M, drop_last=True))
    memory = strategy.step_stats["memory"]
    return {"step_s": statistics.median(timer.steps[2:]),
            "message_bytes": int(strategy.step_stats["p2p_message_bytes"]),
            "activation_peak_bytes": max(r["activation_peak_bytes"] for r in memory.values()),
            "rank": trainer.global_rank, "data_parallel": dp}


def simulated_peaks(args) -> dict[str, float]:
    """The simulator's saved-activation peak per rank (max over pipeline ranks) for each layout."""
    from lightning_bfpp.schedule import ScheduleSpec, build_schedule
    from lightning_bfpp.sim import Cluster, Model, build_costs, simulate

    model = Model(args.layers, args.heads, args.width, args.seq, 256)
    cluster = Cluster(devices=4, num_nodes=1, flops=1e10, device_memory=8e9, intra_bw=2e9, inter_bw=2e9, latency=5e-5)
    schedule = build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=2, micro_batches=M))
    out = {}
    for name, layout in LAYOUTS.items():
        tp = layout["tensor_parallel"]
        costs = build_costs(model, cluster, pipeline_parallel=2, loops=1, data_parallel=4 // (2 * tp),
                            micro_batch_size=MICRO, micro_batches=M, tensor_parallel=tp,
                            sequence_parallel=layout.get("sequence_parallel", False))
        out[name] = max(m.category_peak["activations"] for m in simulate(schedule, costs).memory)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    runs["tp1"].append(run("tp1", args))
    for _ in range(args.repeats):  # alternating: the machine's load drifts
        for name in ("tp2", "tp2+sp"):
            runs[name].append(run(name, args))
    if runs["tp1"][0]["rank"] != 0:
        return
    sim = simulated_peaks(args)
    base, sim_base = runs["tp1"][0]["activation_peak_bytes"], sim["tp1"]
    print(f"example GPT: {args.layers} blocks, width {args.width}, {args.heads} heads, {args.seq} tokens; pp=2, "
          f"{M} micro-batches of {MICRO} sequences, fp32, 4 CPU processes")
    print(f"{'layout':8} {'step s (median)':>16} {'message bytes':>14} {'activation peak MB':>19} {'÷ tp1':>7} "
          f"{'sim ÷ tp1':>10}")
    for name, rs in runs.items():
        step = statistics.median(r["step_s"] for r in rs)
        peak = rs[0]["activation_peak_bytes"]
        print(f"{name:8} {step:16.3f} {rs[0]['message_bytes']:14d} {peak / 1e6:19.2f} {peak / base:7.3f} "
              f"{sim[name] / sim_base:10.3f}")
    ratios = [sp["step_s"] / whole["step_s"] for sp, whole in zip(runs["tp2+sp"], runs["tp2"])]
    print(f"step time, tp2+sp / tp2, per alternation: {', '.join(f'{r:.3f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.3f})")
    print(json.dumps({"runs": {n: [{k: v for k, v in r.items() if k != 'rank'} for r in rs] for n, rs in runs.items()},
                      "simulated_activation_peak_bytes": sim}))


if __name__ == "__main__":
    main()
