"""The export command, ``python -m lightning_bfpp.checkpoint CHECKPOINT (OUT | --hf DIR)``: one plain file
(``export``) or a Hugging Face directory (``hf_dir``)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .export import export
from .hf_dir import export_hf
from .safety import TRUST_ENV, CheckpointError


def main(argv: list[str] | None = None) -> None:
    """``python -m lightning_bfpp.checkpoint CHECKPOINT OUT [--full] [--trust]``: `export` as a command. CHECKPOINT is a
    folder written under ``strategy="bfpp"``, OUT the file to write; ``--full`` adds the optimizer state, loops,
    callbacks and LR schedulers; ``--trust`` unpickles without restrictions. ``CHECKPOINT --hf DIR [--adapters]``:
    `export_hf`, a Hugging Face directory. Exits with ``error: ...`` (status 1)
    when the folder is not a complete, safe checkpoint."""
    p = argparse.ArgumentParser(
        prog="python -m lightning_bfpp.checkpoint",
        description="Export a bfpp (sharded) checkpoint folder to one plain state-dict file.",
    )
    p.add_argument("checkpoint", type=Path, help="checkpoint folder written by strategy='bfpp'")
    p.add_argument("out", type=Path, nargs="?", help="output file, e.g. model.ckpt")
    p.add_argument("--hf", type=Path, metavar="DIR",
                   help="write a Hugging Face directory instead (config, safetensors, tokenizer) of a "
                        "lightning_bfpp.hf.CausalLM checkpoint: what save_pretrained writes")
    p.add_argument("--adapters", action="store_true",
                   help="with --hf and LoRA: write the adapters (adapter_config.json), not the merged model")
    p.add_argument("--full", action="store_true",
                   help="also the optimizer state, loops, callbacks and LR schedulers: a plain Lightning checkpoint "
                        "that strategy='auto' and DDP resume")
    p.add_argument("--trust", action="store_true",
                   help="unpickle without restrictions (only for a checkpoint from a source you trust; or "
                        f"{TRUST_ENV}=1)")
    a = p.parse_args(argv)
    if (a.out is None) == (a.hf is None):
        p.error("give either OUT (a file) or --hf DIR (a Hugging Face directory)")
    if a.adapters and a.hf is None:
        p.error("--adapters goes with --hf DIR")
    try:
        if a.hf is not None:
            print(export_hf(a.checkpoint, a.hf, adapters=a.adapters, trust=a.trust))
            return
        state = export(a.checkpoint, a.out, trust=a.trust, full=a.full)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    n = sum(t.numel() for t in state.values() if isinstance(t, torch.Tensor))
    print(f"wrote {a.out}: {len(state)} tensors, {n:,} parameters")
