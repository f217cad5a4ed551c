"""How long a checkpoint save stops training: BFPPStrategy(async_save=False) vs async_save=True, side by side.

    .venv/bin/python benchmarks/async_save.py [--width 2048] [--layers 8] [--steps 16] [--every 4] [--devices 2]

One launch of `devices` CPU processes (Lightning's launcher) trains an MLP of `layers` width x width linear layers
(AdamW: weights + two moments are written) at pp=2 twice, first with synchronous saves, then with background saves,
calling `trainer.save_checkpoint` every `every` steps. Prints, per mode, the seconds each save call held the
training loop (the stall), the mean step time of the other steps, and the whole fit; then the ratio of stalls
(sync / async). On a shared CPU the background write competes with training for the same cores: the fit times say
what that costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_bfpp import BFPPStrategy, PipelineHooks


class MLP(PipelineHooks, LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, output, target):
        return nn.functional.mse_loss(output, target)

    def forward(self, x):
        return self.pipeline_forward(x)

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class SaveTimer(Callback):
    """Saves every `every` steps from on_train_batch_end and times the call; times the other steps."""

    def __init__(self, folder: Path, every: int) -> None:
        self.folder, self.every = folder, every
        self.stalls: list[float] = []
        self.steps: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, *args) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        took = time.perf_counter() - self._start
        if trainer.global_step % self.every:
            self.steps.append(took)
            return
        start = time.perf_counter()
        trainer.save_checkpoint(self.folder / f"step-{trainer.global_step}.ckpt")
        self.stalls.append(time.perf_counter() - start)


def run(mode: str, args, folder: Path, steps: int | None = None) -> dict:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, args.width), torch.randn(64, args.width))
    timer = SaveTimer(folder / mode, args.every)
    trainer = Trainer(accelerator="cpu", devices=args.devices, max_steps=steps or args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      strategy=BFPPStrategy(pipeline_parallel=2, micro_batches=2, async_save=mode == "async"),
                      callbacks=[timer])
    start = time.perf_counter()
    trainer.fit(MLP(args.width, args.layers), DataLoader(data, batch_size=8, drop_last=True))
    return {"fit_s": time.perf_counter() - start, "stalls": timer.stalls, "steps": timer.steps,
            "rank": trainer.global_rank}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="where the checkpoints go (default: a temp folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = args.out or Path(tempfile.mkdtemp(prefix="bfpp-async-save-"))
    run("warm-up", args, folder, steps=args.every - 1)  # the first fit in a process pays one-time set-up costs
    results = {mode: run(mode, args, folder) for mode in ("sync", "async")}
    if results["sync"]["rank"] != 0:
        return
    params = args.width * (args.width + 1) * args.layers
    print(f"MLP {args.layers} x {args.width}^2 ({params / 1e6:.0f}M parameters, {params * 12 / 1e9:.2f} GB per save "
          f"with AdamW) at pp=2 on {args.devices} CPU processes (batch 8 per replica); a save every {args.every} of "
          f"{args.steps} steps")
    for mode, r in results.items():
        print(f"{mode:5}: save call {statistics.mean(r['stalls']):.3f} s mean "
              f"({', '.join(f'{s:.2f}' for s in r['stalls'])}); "
              f"other steps {statistics.mean(r['steps']):.3f} s mean; fit {r['fit_s']:.1f} s")
    ratio = statistics.mean(results["sync"]["stalls"]) / statistics.mean(results["async"]["stalls"])
    print(f"stall per save, sync / async: {ratio:.1f}x; fit time, sync / async: "
          f"{results['sync']['fit_s'] / results['async']['fit_s']:.2f}x")
    print(json.dumps({m: {k: v for k, v in r.items() if k != "rank"} for m, r in results.items()}))


if __name__ == "__main__":
    main()
