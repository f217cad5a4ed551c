"""What context parallel costs and saves: the example GPT at pp=2 with and without context parallel, side by side in
one launch.

    .venv/bin/python benchmarks/context_parallel.py [--width 256] [--heads 4] [--seq 256] [--layers 4] [--repeats 3]

One launch of 4 CPU processes (Lightning's launcher) fits the same model (fp32, SGD, the micro-batch the same in every
layout: 2 sequences) in two layouts, alternating `repeats` times:
- cp1: pp=2 x dp=2 (global batch 16): each rank holds whole sequences;
- cp2: pp=2 x cp=2 (global batch 8): each rank holds half of every sequence (chunks i and 3-i), attention gathers the
  keys and values of the other half.
Per layout it prints the median step time (after 2 warm-up steps), the largest activation message a rank sends
(``step_stats["p2p_message_bytes"]``), the keys and values one attention layer all-gathers (``kv_gather_bytes``), and
the peak of saved activations per rank (``activation_peak_bytes``, the saved-tensor meter), beside the simulator's
counts for the same layout (``lightning_bfpp.sim``: ``message_bytes``, ``kv_gather_bytes``, and the activation peak of
the simulated step as a ratio to cp1).
"""

from __future__ import annotations

import argparse
import json
import statistics

import common  # noqa: F401  (the repository and examples/ on sys.path)
import torch
from gpt import GPT, GPTConfig, OptimConfig
from lightning.pytorch import Trainer
from sequence_parallel import StepTimer
from torch.utils.data import DataLoader, TensorDataset

from lightning_bfpp import BFPPStrategy

MICRO, M = 2, 2  # sequences per micro-batch, micro-batches per step and replica
LAYOUTS = {"cp1": dict(context_parallel=1), "cp2": dict(context_parallel=2)}


def config(args) -> GPTConfig:
    return GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.seq, vocab_size=256)


def run(name: str, args) -> dict:
    torch.manual_seed(0)
    cp = LAYOUTS[name]["context_parallel"]
    dp = 4 // (2 * cp)
    tokens = torch.randint(0, 256, (64, args.seq + 1), generator=torch.Generator().manual_seed(0))
    timer = StepTimer()
    strategy = BFPPStrategy(pipeline_parallel=2, micro_batches=M, measure_every_n_steps=1, context_parallel=cp)
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, callbacks=[timer])
    model = GPT(config(args), OptimConfig(name="sgd", lr=0.01, warmup_steps=0, min_lr_ratio=1.0))
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=MICRO * M, drop_last=True))
    stats = strategy.step_stats
    return {"step_s": statistics.median(timer.steps[2:]), "message_bytes": int(stats["p2p_message_bytes"]),
            "kv_gather_bytes": int(stats["kv_gather_bytes"]),
            "activation_peak_bytes": max(r["activation_peak_bytes"] for r in stats["memory"].values()),
            "rank": trainer.global_rank, "data_parallel": dp}


def simulated(args) -> dict[str, dict[str, float]]:
    """Per layout, the simulator's message and gathered bytes (fp32) and its saved-activation peak per rank."""
    from lightning_bfpp.schedule import ScheduleSpec, build_schedule
    from lightning_bfpp.sim import Cluster, Model, build_costs, kv_gather_bytes, message_bytes, simulate

    model = Model(args.layers, args.heads, args.width, args.seq, 256)
    cluster = Cluster(devices=4, num_nodes=1, flops=1e10, device_memory=8e9, intra_bw=2e9, inter_bw=2e9, latency=5e-5)
    schedule = build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=2, micro_batches=M))
    out = {}
    for name, layout in LAYOUTS.items():
        cp = layout["context_parallel"]
        layers = model.layers(cluster, context_parallel=cp)
        costs = build_costs(layers, cluster, pipeline_parallel=2, loops=1, data_parallel=4 // (2 * cp),
                            micro_batch_size=MICRO, micro_batches=M, context_parallel=cp)
        out[name] = {"message_bytes": message_bytes(layers, MICRO, activation_bytes=4),
                     "kv_gather_bytes": kv_gather_bytes(layers, MICRO, activation_bytes=4),
                     "activation_peak_bytes": max(m.category_peak["activations"]
                                                  for m in simulate(schedule, costs).memory)}
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
    for _ in range(args.repeats):  # alternating: the machine's load drifts
        for name in LAYOUTS:
            runs[name].append(run(name, args))
    if runs["cp1"][0]["rank"] != 0:
        return
    sim = simulated(args)
    base, sim_base = runs["cp1"][0]["activation_peak_bytes"], sim["cp1"]["activation_peak_bytes"]
    print(f"example GPT: {args.layers} blocks, width {args.width}, {args.heads} heads, {args.seq} tokens; pp=2, "
          f"{M} micro-batches of {MICRO} sequences, fp32, 4 CPU processes")
    print(f"{'layout':7} {'step s':>8} {'message B':>10} {'sim':>10} {'K/V gathered B':>15} {'sim':>10} "
          f"{'activation peak MB':>19} {'÷ cp1':>6} {'sim ÷ cp1':>10}")
    for name, rs in runs.items():
        step, r, s = statistics.median(x["step_s"] for x in rs), rs[0], sim[name]
        print(f"{name:7} {step:8.3f} {r['message_bytes']:10d} {s['message_bytes']:10.0f} {r['kv_gather_bytes']:15d} "
              f"{s['kv_gather_bytes']:10.0f} {r['activation_peak_bytes'] / 1e6:19.2f} "
              f"{r['activation_peak_bytes'] / base:6.3f} {s['activation_peak_bytes'] / sim_base:10.3f}")
    ratios = [b["step_s"] / a["step_s"] for a, b in zip(runs["cp1"], runs["cp2"])]
    print(f"step time, cp2 / cp1 (a cp2 rank computes half of a cp1 rank's tokens, plus the gathers), per "
          f"alternation: {', '.join(f'{x:.3f}' for x in ratios)} (median {statistics.median(ratios):.3f})")
    print(json.dumps({"runs": {n: [{k: v for k, v in r.items() if k != 'rank'} for r in rs] for n, rs in runs.items()},
                      "simulated": sim}))


if __name__ == "__main__":
    main()
