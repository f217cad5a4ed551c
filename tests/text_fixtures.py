"""Local text data for the data tests and the end-to-end run, made in seconds with nothing downloaded: documents
written from the standard library's docstrings, a BPE tokenizer trained on them with ``tokenizers`` (saved as a
Hugging Face tokenizer, with a chat template), and a tiny Llama saved with ``save_pretrained``."""
from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<pad>", "<s>", "</s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


def documents(n: int = 400, seed: int = 0) -> list[str]:
    """`n` short English documents: docstrings of standard-library functions, joined a few at a time."""
    import inspect
    import json as json_module
    import os
    import pathlib
    import re
    import string
    import textwrap

    texts = []
    for module in (os, re, json_module, string, textwrap, pathlib, inspect, random):
        for name in sorted(dir(module)):
            doc = inspect.getdoc(getattr(module, name, None))
            if doc and 40 < len(doc) < 2000 and not doc.startswith(("int(", "str(", "Built-in")):
                texts.append(" ".join(doc.split()))
    texts = sorted(set(texts))
    rng = random.Random(seed)
    return [" ".join(rng.sample(texts, rng.randint(1, 3))) for _ in range(n)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def train_tokenizer(path: Path, texts: list[str], vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer trained on `texts` (seconds), saved with save_pretrained in `path`: bos <s>,
    eos </s>, pad <pad>, and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def save_llama(path: Path, vocab_size: int, block_size: int = 64, seed: int = 0) -> Path:
    """A tiny random-init Llama (2 layers, width 64) written by save_pretrained."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=vocab_size, max_position_embeddings=block_size,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path
