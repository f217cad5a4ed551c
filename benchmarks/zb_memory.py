"""What zero-bubble breadth-first holds in memory beside breadth-first, in one process (pp=1, loops 2: two stages on
one rank, so the order of the input- and weight-gradient passes is what differs, not the machine's noise).

    .venv/bin/python benchmarks/zb_memory.py [--width 256] [--layers 4] [--seq 128] [--micro-batches 4]

Per schedule: the saved-activation peak (``activation_peak_bytes``, the runtime's saved-tensor meter) and, for
breadth_first_zb, the largest sum over the step of the gradients torch's split backward keeps from a micro-batch's
input-gradient pass for its weight-gradient pass (read from the stages' ``backward_state`` after each action: the
gradients at the points where the paths to the inputs and to the weights part). Those are not saved tensors: the
meter does not see them and the simulator does not count them. Both are printed as ratios to breadth_first's peak.
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import Trainer
from torch.distributed.pipelining import PipelineStage

import common  # noqa: F401  (the repository and examples/ on sys.path)
from gpt import GPT, GPTConfig  # noqa: E402

from lightning_bfpp import BFPPStrategy  # noqa: E402


def retained_grad_bytes(stage: PipelineStage) -> int:
    """Bytes of the gradients `stage` keeps for weight-gradient passes still to run (torch's private state)."""
    total = 0
    for _inputs, groups, _outputs, _grads in getattr(stage, "backward_state", {}).values():
        for group in groups or []:
            for grads in group.get("grads") or []:
                total += sum(g.numel() * g.element_size() for g in grads if g is not None)
    return total


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
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch)
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
    print(f"{'schedule':<18}{'saved peak':>13}{'÷ bf':>7}{'W grads peak':>14}{'÷ bf':>7}{'together peak':>15}{'÷ bf':>7}")
    for name, r in rows.items():
        saved, kept, both = r["saved_peak"], r["retained_grads_peak"], r["together_peak"]
        print(f"{name:<18}{saved:>13,}{saved / base:>7.3f}{kept:>14,}{kept / base:>7.3f}{both:>15,}{both / base:>7.3f}")


if __name__ == "__main__":
    main()
