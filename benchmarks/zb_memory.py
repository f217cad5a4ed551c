"""What zero-bubble breadth-first holds in memory beside breadth-first, in one process (pp=1, loops 2: two stages on
one rank, so the order of the input- and weight-gradient passes is what differs, not the machine's noise).

    .venv/bin/python benchmarks/zb_memory.py [--width 256] [--layers 4] [--seq 128] [--micro-batches 4]

Per schedule: the saved-activation peak (``activation_peak_bytes``, the runtime's saved-tensor meter) and, for
breadth_first_zb, the largest sum over the step of the gradients torch's split backward keeps from a micro-batch's
input-gradient pass for its weight-gradient pass (read from the stages' ``backward_state`` after each action: the
gradients at the points where the paths to the inputs and to the weights part, and the gradient of the stage's
output). Those are not saved tensors: the meter does not see them. Both are printed as ratios to breadth_first's
peak, beside the simulator's peak of both from the same model's measured layers (``StageCost.weight_pass_bytes``).
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (the repository and examples/ on sys.path)
import torch
from gpt import GPT, GPTConfig
from lightning.pytorch import Trainer
from torch.distributed.pipelining import PipelineStage

from lightning_bfpp import BFPPStrategy


def retained_grad_bytes(stage: PipelineStage) -> int:
    """Bytes of the gradients `stage` keeps for weight-gradient passes still to run (torch's private state): those
    of the points where the paths part, and the gradient its output received."""
    total = 0
    for _inputs, groups, _outputs, output_grads in getattr(stage, "backward_state", {}).values():
        kept = [g for group in groups or [] for grads in group.get("grads") or [] for g in grads]
        kept += list(output_grads) if isinstance(output_grads, (tuple, list)) else [output_grads]
        total += sum(g.numel() * g.element_size() for g in kept if isinstance(g, torch.Tensor))
    return total


def simulated(cfg: GPTConfig, micro_batches: int, micro_batch_size: int) -> dict[str, float]:
    """The simulator's peak of saved activations + what the weight passes wait for (one rank, two stages), from
    the same model's measured layers (``layout.auto.measure_layers``: fp32, as this run)."""
    from lightning_bfpp.layout.auto import measure_layers
    from lightning_bfpp.schedule import ScheduleSpec, build_schedule
    from lightning_bfpp.sim import Cluster, build_costs, simulate

    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.block_size))
    layers = measure_layers(model, list(model.pipeline_layers()), ids, ids, torch.device("cpu"), repeats=1)
    cluster = Cluster(devices=1, num_nodes=1, flops=1e10, device_memory=1e12, intra_bw=1e9, inter_bw=1e9, latency=1e-5)
    costs = build_costs(layers, cluster, pipeline_parallel=1, loops=2, data_parallel=1,
                        micro_batch_size=micro_batch_size, micro_batches=micro_batches,
                        sharding="none")  # no FSDP: the peak is activations + W's
    out = {}
    for name in ("breadth_first", "breadth_first_zb"):
        memory = simulate(build_schedule(ScheduleSpec(name, pipeline_parallel=1, micro_batches=micro_batches, loops=2)),
                          costs).memory[0]
        out[name] = memory.peak - memory.static
    return out


def fit(schedule: str, cfg: GPTConfig, micro_batches: int, batch: int, steps: int = 3) -> dict:
    stages: dict[int, PipelineStage] = {}
    peaks = {"retained": 0, "both": 0}
    strategy = BFPPStrategy(pipeline_parallel=1, loops=2, micro_batches=micro_batches, schedule=schedule,
                            measure_every_n_steps=1)
    originals = {}
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        originals[name] = inner = getattr(PipelineStage, name)

        def wrapped(self, *args, _inner=inner, **kwargs):
            out = _inner(self, *args, **kwargs)
            stages[self.stage_index] = self
            retained = sum(retained_grad_bytes(s) for s in stages.values())
            peaks["retained"] = max(peaks["retained"], retained)
            peaks["both"] = max(peaks["both"], retained + strategy.runner.meter.current)
            return out

        setattr(PipelineStage, name, wrapped)
    try:
        torch.manual_seed(0)
        data = torch.randint(0, cfg.vocab_size, (batch * steps, cfg.block_size + 1))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]),
                                             batch_size=batch)
        Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, strategy=strategy,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(GPT(cfg), loader)
    finally:
        for name, inner in originals.items():
            setattr(PipelineStage, name, inner)
    saved = strategy.step_stats["memory"][0]["activation_peak_bytes"]
    return {"saved_peak": saved, "retained_grads_peak": peaks["retained"], "together_peak": max(saved, peaks["both"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    args = ap.parse_args()
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.seq)
    batch = args.micro_batches * args.micro_batch_size
    rows = {name: fit(name, cfg, args.micro_batches, batch) for name in ("breadth_first", "breadth_first_zb")}
    base = rows["breadth_first"]["saved_peak"]
    print(f"GPT {args.layers} x {args.width}, {args.seq} tokens, pp=1 x loops=2, {args.micro_batches} micro-batches "
          f"of {args.micro_batch_size}; ratios to breadth_first's saved-activation peak")
    print(f"{'schedule':<18}{'saved peak':>13}{'÷ bf':>7}{'W grads peak':>14}{'÷ bf':>7}{'together peak':>15}"
          f"{'÷ bf':>7}")
    for name, r in rows.items():
        saved, kept, both = r["saved_peak"], r["retained_grads_peak"], r["together_peak"]
        print(f"{name:<18}{saved:>13,}{saved / base:>7.3f}{kept:>14,}{kept / base:>7.3f}{both:>15,}{both / base:>7.3f}")
    sim = simulated(cfg, args.micro_batches, args.micro_batch_size)
    measured = {name: r["together_peak"] for name, r in rows.items()}
    print("the simulator's peak of both (measured layers), and ÷ the measured peak of both:")
    for name, peak in sim.items():
        print(f"{name:<18}{peak:>15,.0f}{peak / measured[name]:>7.3f}")
    print("zero bubble ÷ breadth-first, both at once: measured "
          f"{measured['breadth_first_zb'] / measured['breadth_first']:.3f}, "
          f"simulated {sim['breadth_first_zb'] / sim['breadth_first']:.3f}")


if __name__ == "__main__":
    main()
