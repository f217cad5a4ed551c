"""Per-rank peak host memory while a pretrained Hugging Face model is built and loaded under bfpp.

Saves a random-init Llama of ~100 M parameters in bf16 with save_pretrained (as pretrained checkpoints usually are),
then starts it in fp32 (Lightning's 32-true and bf16-mixed keep fp32 weights) at pp=2 x loops=2 on 2 processes
twice, side by side in one run:
  eager  CausalLM(LlamaForCausalLM.from_pretrained(dir)): every process loads the whole model, then bfpp cuts it;
  staged CausalLM.from_pretrained(dir): built on the meta device, each rank reads only its own stages' tensors.
Each rank reports its peak RSS (VmHWM) before building the model and after setup (the first training batch
starts), and the bytes of the parameters it keeps; the added peak is compared with the whole model and with its share.

    python benchmarks/pretrained_memory.py            # ~1-2 minutes on 2 cores
    python benchmarks/pretrained_memory.py --small    # a 4-layer model: checks the code path in seconds
Not part of `make bench`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM: reset by exec, unlike ru_maxrss, which a child inherits)."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def save_model(directory: Path, small: bool) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    layers, width = (4, 256) if small else (8, 768)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                                   intermediate_size=width * 8 // 3 // 64 * 64, num_attention_heads=width // 64,
                                   num_key_value_heads=width // 128, vocab_size=32000, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)  # as pretrained checkpoints are usually stored
    model.save_pretrained(directory)
    return sum(p.numel() * 4 for p in model.parameters())  # trained in fp32


def worker(mode: str, directory: str, out: str) -> None:
    """One launch of 2 processes (Lightning's launcher runs this again in the second one)."""
    import torch
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bfpp import BFPPStrategy
    from lightning_bfpp.hf import CausalLM

    before = peak_rss()

    class Report(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                held = sum(p.numel() * p.element_size() for p in pl_module.parameters())
                Path(out, f"{mode}-rank{trainer.global_rank}.json").write_text(json.dumps(
                    {"before": before, "after": peak_rss(), "held": held}))

    if mode == "eager":
        import transformers

        model = CausalLM(transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32), check=False)
    else:
        model = CausalLM.from_pretrained(directory)
    tokens = torch.randint(0, 32000, (8, 17), generator=torch.Generator().manual_seed(0))  # the same in every process
    trainer = Trainer(accelerator="cpu", devices=2,
                      strategy=BFPPStrategy(pipeline_parallel=2, loops=2, micro_batches=2), max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Report()])
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--worker", nargs=3, metavar=("MODE", "DIR", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, out = Path(tmp, "model"), Path(tmp)
        size = save_model(model_dir, args.small)
        rows = []
        for mode in ("eager", "staged"):
            subprocess.run([sys.executable, __file__, "--worker", mode, str(model_dir), str(out)], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
            for rank in (0, 1):
                r = json.loads(Path(out, f"{mode}-rank{rank}.json").read_text())
                rows.append({"mode": mode, "rank": rank, "added_mb": (r["after"] - r["before"]) / MB,
                             "before_mb": r["before"] / MB, "held_mb": r["held"] / MB})
    print(f"model: {size / MB:.0f} MB of fp32 parameters (stored in bf16), pp=2 x loops=2 on 2 processes")
    print(f"{'mode':8}{'rank':>5}{'held MB':>10}{'peak before MB':>16}{'peak added MB':>15}{'÷ model':>9}"
          f"{'÷ held':>8}")
    for r in rows:
        print(f"{r['mode']:8}{r['rank']:>5}{r['held_mb']:>10.0f}{r['before_mb']:>16.0f}{r['added_mb']:>15.0f}"
              f"{r['added_mb'] * MB / size:>9.2f}{r['added_mb'] / r['held_mb']:>8.2f}")
    eager = max(r["added_mb"] for r in rows if r["mode"] == "eager")
    staged = max(r["added_mb"] for r in rows if r["mode"] == "staged")
    print(f"largest rank's added peak, staged ÷ eager: {staged / eager:.2f}")


if __name__ == "__main__":
    main()
