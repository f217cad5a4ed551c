"""A bfpp checkpoint of a Hugging Face causal LM (``lightning_bfpp.hf.CausalLM``) as the directory ``save_pretrained``
writes: config.json, safetensors shards, the tokenizer the run read its text with; LoRA adapters merged into the
weights, or written as PEFT's adapter directory. ``CausalLM`` records the model's config (and its LoRA configs and
tokenizer) in each checkpoint (`HF_RECORD`); the stored keys are then the installed transformers' own, since its
``save_pretrained`` writes them (mixture-of-experts models' experts one per key included). Loads the whole model in
this process (``python -m lightning_bfpp.checkpoint CKPT --hf DIR``)."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from .export import consolidate
from .safety import CheckpointError

HF_RECORD = "hf_model"  # the checkpoint's record of the model: {"config", "peft", "tokenizer"}, JSON strings and paths


def hf_record(config: Any, peft_configs: dict[str, Any] | None, tokenizer: str | None,
              base: str | None = None) -> dict[str, Any]:
    """What a checkpoint records of a Hugging Face model (plain data: read without running code): its config, its
    LoRA adapters' configs ({adapter name: config}), the tokenizer directory or name of the run, the directory the
    pretrained weights came from (`base`: what exported adapters adapt)."""
    def plain(value: Any) -> Any:
        return sorted(value) if isinstance(value, set) else str(value)

    peft = {name: json.dumps(c.to_dict(), default=plain) for name, c in (peft_configs or {}).items()}
    return {"config": config.to_json_string(use_diff=False), "peft": peft,
            "tokenizer": str(tokenizer) if tokenizer else None, "base": str(base) if base else None}


def export_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, adapters: bool = False,
              trust: bool = False, max_shard_size: str | int = "5GB") -> Path:
    """Write `checkpoint_dir` (a bfpp checkpoint folder of a ``CausalLM``) to `out_dir` as ``save_pretrained`` writes
    the model: config, safetensors (in shards of `max_shard_size`), the run's tokenizer. LoRA adapters are merged into
    the weights (a plain model), or with `adapters` written as PEFT's adapter directory (adapter_config.json,
    adapter_model.safetensors; the base model is the one the run fine-tuned). `out_dir` appears whole or not at all.
    Returns `out_dir`."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--hf {out}: exists and is not an empty folder; name a new one.")
    if not out.parent.is_dir():
        raise CheckpointError(f"--hf {out}: the folder {out.parent} does not exist; create it first.")
    state, meta = consolidate(Path(checkpoint_dir), trust)
    record = meta.get(HF_RECORD)
    if not isinstance(record, dict) or "config" not in record:
        raise CheckpointError(f"{checkpoint_dir} records no Hugging Face model (it was not written from a "
                              "lightning_bfpp.hf.CausalLM, or by lightning-bfpp before --hf): export it to a file "
                              "(python -m lightning_bfpp.checkpoint CKPT OUT.pt) and load that into your class.")
    if adapters and not record.get("peft"):
        raise CheckpointError(f"--adapters: {checkpoint_dir} holds no LoRA adapters; leave --adapters out.")
    model = _model(record, state)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        if record.get("peft") and not adapters:
            model = model.merge_and_unload()
        elif adapters and record.get("base"):  # the adapters' base model, as PEFT records it
            for config in model.peft_config.values():
                config.base_model_name_or_path = record["base"]
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if record.get("tokenizer"):
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(record["tokenizer"]).save_pretrained(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _model(record: dict[str, Any], state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The Hugging Face model (a PeftModel with LoRA) of `record` holding `state`, loaded strictly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(record["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    floats = [t.dtype for t in state.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    model = AutoModelForCausalLM.from_config(config, dtype=floats[0] if floats else None)
    if record.get("peft"):
        from peft import LoraConfig, get_peft_model

        items = list(record["peft"].items())
        for i, (name, text) in enumerate(items):
            settings = json.loads(text)
            known = {k: v for k, v in settings.items() if k in LoraConfig.__dataclass_fields__}
            lora = LoraConfig(**{**known, "inference_mode": False})
            if i == 0:
                model = get_peft_model(model, lora, adapter_name=name)
            else:
                model.add_adapter(name, lora)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint's tensors do not fit {type(model).__name__} built from its recorded "
                              f"config: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}.")
    return model
