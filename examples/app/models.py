"""The model a run trains: the example GPT (examples/gpt.py) or a Hugging Face causal LM (random-init GPT-2 / Llama,
or a save_pretrained directory read per stage), with LoRA adapters when ``model.lora.r`` is set."""
from __future__ import annotations

import dataclasses

import lightning as L
from gpt import GPT, GPTConfig, OptimConfig
from omegaconf import DictConfig, OmegaConf

from lightning_bfpp.hf import CausalLM
from lightning_bfpp.hf.lora import lora_config


def from_config(cls, node: DictConfig):
    """The dataclass `cls` from the config keys that are its fields."""
    values = OmegaConf.to_container(node, resolve=True)
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def model_config(cfg: DictConfig) -> GPTConfig:
    """GPTConfig from `model.*` (the yaml may hold more keys, e.g. for the planner). Activation checkpointing
    is applied in one place: by the GPT's blocks under strategy=auto, by the strategy under bfpp
    (build_strategy), where the blocks' own is switched off so that nothing is recomputed twice."""
    model_cfg = from_config(GPTConfig, cfg.model)
    if cfg.trainer.strategy == "bfpp":
        model_cfg = dataclasses.replace(model_cfg, activation_checkpointing=False)
    return model_cfg


class HFCausalLM(CausalLM):
    """A Hugging Face causal LM with the app's optimizer: the example GPT's parameter groups (no weight decay on
    biases and norms) and warmup + cosine schedule, from `optim.*`."""

    def __init__(self, model, optim: OptimConfig | None = None, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.optim = optim

    configure_optimizers = GPT.configure_optimizers  # uses only self.optim, self.parameters() and self.trainer


def hf_model(m: DictConfig):
    """A random-init GPT2LMHeadModel (model.family=hf_gpt2) or LlamaForCausalLM (hf_llama) from `model.*`, built
    locally: nothing is downloaded."""
    import transformers

    common = dict(vocab_size=m.vocab_size, tie_word_embeddings=m.tie_weights, attn_implementation=m.attn_implementation)
    if m.family == "hf_gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, n_positions=m.block_size, resid_pdrop=m.dropout,
            embd_pdrop=m.dropout, attn_pdrop=m.dropout, bos_token_id=0, eos_token_id=0, **common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=m.n_layer, num_attention_heads=m.n_head, num_key_value_heads=m.n_kv_head,
        hidden_size=m.n_embd, intermediate_size=m.intermediate_size, max_position_embeddings=m.block_size,
        attention_dropout=m.dropout, bos_token_id=0, eos_token_id=0, **common))


def build_model(cfg: DictConfig) -> L.LightningModule:
    """The model of `model.family`: gpt (examples/gpt.py; the default), hf_gpt2 / hf_llama (hf_model, wrapped by
    lightning_bfpp.hf.CausalLM: n_layer + 2 pipeline layers like the GPT) or hf_pretrained (a save_pretrained
    directory, model.path, read per stage). Activation checkpointing under strategy=auto:
    the GPT's blocks, or Hugging Face's own gradient checkpointing; under bfpp the strategy's (build_strategy)."""
    optim = from_config(OptimConfig, cfg.optim)
    optim.betas = tuple(optim.betas)
    if cfg.model.get("family", "gpt") == "gpt":
        return GPT(model_config(cfg), optim)
    lora = lora_settings(cfg)
    if cfg.model.family == "hf_pretrained":  # built on the meta device; each rank reads its own stages' tensors
        lm = HFCausalLM.from_pretrained(cfg.model.path, attn_implementation=cfg.model.attn_implementation, lora=lora)
        lm.optim = optim
    else:
        model = hf_model(cfg.model)
        if lora is not None:  # only the adapters train
            from peft import get_peft_model

            model = get_peft_model(model, lora)
        lm = HFCausalLM(model, optim)
    if cfg.model.activation_checkpointing and cfg.trainer.strategy != "bfpp":
        lm.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return lm


def lora_settings(cfg: DictConfig):
    """The ``peft.LoraConfig`` of `model.lora` (None when model.lora.r is null: every weight trains)."""
    settings = OmegaConf.to_container(cfg.model.lora, resolve=True) if cfg.model.get("lora") is not None else {}
    return lora_config(settings) if settings.get("r") is not None else None

