"""Text from a Hugging Face directory (what `checkpoint.export_hf=DIR` or `python -m lightning_bfpp.checkpoint CKPT
--hf DIR` writes), with transformers' own `generate`: see that a fine-tune learnt something.
python examples/generate.py DIR "prompt"                        # sampled (top-k 20), 40 new tokens
python examples/generate.py DIR "prompt" --greedy --max-new-tokens 20
A directory without a tokenizer (the byte corpus' models: token id = byte value) reads and writes bytes. A directory
of LoRA adapters (`--hf DIR --adapters`) loads on the base model its adapter_config.json names."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch


def load(directory: Path):
    """(model, tokenizer or None) of `directory`: a model, or LoRA adapters on their base model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (directory / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(directory)
    else:
        model = AutoModelForCausalLM.from_pretrained(directory)
    has_tokenizer = any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return model.eval(), AutoTokenizer.from_pretrained(directory) if has_tokenizer else None


def generate(directory: Path, prompt: str, max_new_tokens: int = 40, greedy: bool = False, seed: int = 0) -> str:
    """The prompt and its continuation, as text."""
    model, tokenizer = load(directory)
    ids = (tokenizer(prompt, return_tensors="pt").input_ids if tokenizer is not None
           else torch.tensor([list(prompt.encode())]))
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=not greedy, top_k=None if greedy else 20,
                             pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0)
    if tokenizer is not None:
        return tokenizer.decode(out[0], skip_special_tokens=True)
    return bytes(min(int(t), 255) for t in out[0]).decode(errors="replace")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Generate text from a Hugging Face directory with transformers' generate.")
    p.add_argument("directory", type=Path, help="a save_pretrained directory (or LoRA adapters)")
    p.add_argument("prompt", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--greedy", action="store_true", help="the most likely token each time (default: top-k sampling)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not (a.directory / "config.json").is_file() and not (a.directory / "adapter_config.json").is_file():
        p.error(f"{a.directory} has no config.json: give a directory written by save_pretrained or by "
                "checkpoint.export_hf")
    print(generate(a.directory, a.prompt, a.max_new_tokens, a.greedy, a.seed))


if __name__ == "__main__":
    main()
