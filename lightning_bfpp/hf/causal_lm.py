"""Hugging Face causal language models (GPT-2, and the Llama family: any model whose config has a
`base_model_pp_plan`) as pipeline layers. The model's own modules are listed as they are (decoder layers),
or wrapped without being registered (embedding, final norm + head, decoder layers of models that mix
attention types), so stages and checkpoints keep the model's own parameter names. What the model's own
forward adds around its modules (position ids, rotary cos/sin, causal and sliding-window masks, logit
scaling and soft-capping) is recomputed here; `CausalLM` checks once, at construction, that the layers
reproduce the model's own logits, and refuses a model they do not. Needs `pip install lightning-bfpp[hf]`;
nothing is downloaded."""
from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from ..contract.hooks import PipelineHooks
from ..layout.materialize import has_meta_tensors, seeded_init
from .pretrained import HUB_KWARGS, SafetensorsWeights, build_on_meta, local_directory, stored_names
from .tensor_parallel import hf_layer_plan

# attention kernels that are causal (and windowed, from the layer's own `sliding_window`) without a mask
MASK_FREE = ("flash_attention_2", "flash_attention_3")
ATTENTION_TYPES = ("full_attention", "sliding_attention")
PROBE_TOKENS = 16  # the construction check's sequence length (longer when a sliding window is shorter than 64)


class TokenEmbedding(nn.Module):
    """GPT-2's input: token + learned position embedding, then dropout (not registered: the model owns them)."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(input_ids) + self.wpe(position_ids))  # (B, T, D)


class ScaledEmbedding(nn.Module):
    """A token embedding times the model's ``config.embedding_multiplier`` (Granite)."""

    def __init__(self, embed: nn.Module, multiplier: float):
        super().__init__()
        self.embed, self.multiplier = embed, multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids) * self.multiplier


class OutputHead(nn.Module):
    """Final norm and vocabulary projection, then what the model's own forward does to the logits: Cohere's
    ``logit_scale`` (times), Granite's ``logits_scaling`` (divided by), Gemma's ``final_logit_softcapping``.
    Not registered: the model owns the modules."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, config: Any = None):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.multiplier = getattr(config, "logit_scale", None)
        self.divisor = getattr(config, "logits_scaling", None)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def forward(self, hidden_states: torch.Tensor, *_: Any) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden_states))  # (B, T, vocab)
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class TypedDecoderLayer(nn.Module):
    """A decoder layer of a model that mixes attention types (sliding-window and full layers: Gemma 3, Cohere 2,
    Ministral, ...): it takes the mask and rotary cos/sin of its own type. Not registered."""

    def __init__(self, layer: nn.Module, attention_type: str):
        super().__init__()
        self.layer, self.attention_type = layer, attention_type

    def forward(self, hidden_states: torch.Tensor, *, position_ids: torch.Tensor, per_attention_type: dict) -> Any:
        return self.layer(hidden_states, position_ids=position_ids, **per_attention_type[self.attention_type])


def attention_types(model: nn.Module) -> list[str]:
    """Each decoder layer's attention type, as the model's own forward picks its mask: ``config.layer_types``,
    else sliding for every layer when ``config.sliding_window`` is set (Mistral, Mixtral, Phi-3, Starcoder2)."""
    config = model.config
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"] * n
    unknown = sorted(set(types[:n]) - set(ATTENTION_TYPES))
    if unknown:
        raise ValueError(
            f"{type(model).__name__} has layers of attention type {unknown[0]!r}; lightning_bfpp.hf builds the masks of "
            f"{' and '.join(ATTENTION_TYPES)} layers only: list its layers and side inputs yourself "
            "(docs/huggingface.md)."
        )
    return list(types[:n])


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack: ``model.base_model``, or ``model.model`` where the former is the model itself (Gemma 3's
    text model in transformers 4.x)."""
    base = model.base_model
    return getattr(model, "model", base) if base is model else base


def causal_lm_layers(model: nn.Module) -> list[nn.Module]:
    """`model` (a ``*ForCausalLM``) as ordered pipeline layers: its decoder layers as they are (wrapped when they
    mix attention types), plus an input and an output layer wrapping its embedding and its final norm +
    ``lm_head``."""
    base, head, config = base_model(model), model.get_output_embeddings(), model.config
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head): pass a *ForCausalLM model.")
    if all(hasattr(base, n) for n in ("wte", "wpe", "h", "ln_f")):  # GPT-2 layout
        return [TokenEmbedding(base.wte, base.wpe, base.drop), *base.h, OutputHead(base.ln_f, head, config)]
    plan = getattr(config, "base_model_pp_plan", None)
    if not plan:
        raise ValueError(
            f"lightning_bfpp.hf knows GPT-2 and models whose config has base_model_pp_plan (Llama, Mistral, Qwen2, ...); "
            f"{type(model).__name__} has neither: list its layers in pipeline_layers() yourself (docs/huggingface.md)."
        )
    types = attention_types(model)
    mixed = len(set(types)) > 1
    *body, norm = [getattr(base, name) for name in plan]  # e.g. embed_tokens, layers, norm
    layers: list[nn.Module] = []
    for mod in body:
        if isinstance(mod, nn.ModuleList):
            decoders = list(mod[: config.num_hidden_layers])
            layers.extend([TypedDecoderLayer(d, t) for d, t in zip(decoders, types)] if mixed else decoders)
        elif getattr(config, "embedding_multiplier", 1.0) != 1.0:  # Granite scales the token embedding
            layers.append(ScaledEmbedding(mod, config.embedding_multiplier))
        else:
            layers.append(mod)
    return [*layers, OutputHead(norm, head, config)]


def attention_mask(seq: int, window: int | None, implementation: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The mask the model's attention kernel needs for a full-length causal sequence: none for flash attention
    (causal and windowed by itself) and for sdpa without a window (``is_causal``); a boolean (1, 1, T, T) mask
    for sdpa with a window (True: attend); an additive one for eager attention."""
    if implementation in MASK_FREE or (window is None and implementation == "sdpa"):
        return None
    pos = torch.arange(seq, device=device)
    allowed = pos[None, :] <= pos[:, None]  # (T_query, T_key): keys up to the query
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window  # the last `window` keys, as transformers' sliding window
    if implementation == "sdpa":
        return allowed[None, None]
    return torch.zeros(seq, seq, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@functools.cache
def _rotary_per_type(cls: type) -> bool:
    """Whether a rotary module class makes cos/sin per attention type (``forward(x, position_ids, layer_type)``):
    read once per class, not per micro-batch."""
    return "layer_type" in inspect.signature(cls.forward).parameters


def causal_lm_side_inputs(model: nn.Module, input_ids: torch.Tensor) -> dict[str, Any]:
    """What the model's own forward computes once and hands to every decoder layer: position ids, rotary cos/sin
    (in the default dtype: bf16 under precision='bf16-true') and the attention mask, per attention type when
    the layers mix types (then under ``per_attention_type``, read by ``TypedDecoderLayer``)."""
    seq, device, dtype = input_ids.shape[1], input_ids.device, torch.get_default_dtype()
    position_ids = torch.arange(seq, device=device).unsqueeze(0)  # (1, T)
    config = model.config
    base = base_model(model)
    rotary = getattr(base, "rotary_emb", None)
    per_type_rotary = rotary is not None and _rotary_per_type(type(rotary))
    types = attention_types(model) if hasattr(config, "num_hidden_layers") else ["full_attention"]
    per_type: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(types):
        inputs: dict[str, Any] = {}
        if rotary is not None:
            x = torch.empty(0, dtype=dtype, device=device)
            inputs["position_embeddings"] = rotary(x, position_ids, kind) if per_type_rotary else rotary(x, position_ids)
        window = config.sliding_window if kind == "sliding_attention" else None
        mask = attention_mask(seq, window, config._attn_implementation, dtype, device)
        if mask is not None:
            inputs["attention_mask"] = mask
        per_type[kind] = inputs
    if len(per_type) > 1:
        return {"position_ids": position_ids, "per_attention_type": per_type}
    return {"position_ids": position_ids, **per_type[types[0]]}


def check_layers_reproduce(model: nn.Module, pipeline_forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Run the model's own forward and `pipeline_forward` (its layers in order, side inputs as under bfpp) on a
    short deterministic sequence and raise a ValueError naming the model when the logits differ: its forward
    does something these layers do not. Costs two forward passes of 2 x 16 tokens (more for a short sliding
    window)."""
    config = model.config
    window = getattr(config, "sliding_window", None) or 0
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or PROBE_TOKENS
    seq = min(limit, max(PROBE_TOKENS, window + 1 if window < 64 else 0))
    device = next(model.parameters()).device
    ids = (torch.arange(2 * seq, device=device).view(2, seq) * 7919 + 3) % config.vocab_size  # no RNG drawn
    name = type(model).__name__
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                expected = model(ids).logits
            except Exception as err:
                raise ValueError(f"CausalLM: {name}'s own forward fails on a 2 x {seq} token probe: {err}") from err
            try:
                got = pipeline_forward(ids)
            except Exception as err:
                raise ValueError(
                    f"CausalLM: {name}'s layers cannot run one after another as lightning_bfpp.hf calls them ({type(err).__name__}: "
                    f"{err}). List its layers and side inputs yourself (docs/huggingface.md)."
                ) from err
    finally:
        model.train(training)
    gap = float("inf")
    if got.shape == expected.shape:
        gap = ((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-6)).item()
    if gap > max(1e-5, 2 * torch.finfo(expected.dtype).eps):  # the same ops in the same order: equal up to rounding
        raise ValueError(
            f"CausalLM: {name}'s pipeline layers do not reproduce its own forward (logits {tuple(got.shape)} vs "
            f"{tuple(expected.shape)}, largest difference {gap:.2g} of the largest logit, on 2 x {seq} tokens): its forward "
            "does something lightning_bfpp.hf does not know. List its layers and side inputs yourself "
            "(docs/huggingface.md), or pass check=False at your own risk."
        )


def _check_meta_buffers(model: nn.Module) -> None:
    """transformers 4.x's ``_init_weights`` does not recompute buffers (GPT-2's causal masks): refuse a model whose
    buffers are on the meta device there, rather than train on uninitialized masks (rotary frequencies are
    recomputed by CausalLM; transformers 5 recomputes every buffer it makes)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).major >= 5:
        return
    unknown = [n for n, b in model.named_buffers() if b.is_meta and not n.endswith("inv_freq")]
    if unknown:
        raise ValueError(
            f"CausalLM: {type(model).__name__} was built on the meta device with transformers {transformers.__version__}, "
            f"which does not recompute its buffers ({unknown[0]}, ...): use CausalLM.from_pretrained(path) (buffers stay "
            "real), build the model in memory, or use transformers >= 5."
        )


class CausalLM(PipelineHooks, LightningModule):
    """A Hugging Face ``*ForCausalLM`` as a pipelinable LightningModule, with the model's own state-dict keys.

    The model's top-level modules (``transformer``/``model``, ``lm_head``) are registered on this module itself,
    so ``state_dict()`` and checkpoints exported with ``python -m lightning_bfpp.checkpoint`` load into the plain
    Hugging Face class with ``load_state_dict(strict=True)``. Batches are ``(input_ids, targets)`` with targets
    already shifted (the next token; -100 is ignored). Tied embeddings become one copy per stage, kept identical.

    Args:
        model: e.g. ``GPT2LMHeadModel(config)`` or ``LlamaForCausalLM(config)`` (dropout draws differ per process).
        optimizer: parameters -> optimizer (default: AdamW, lr 3e-4).
        check: run the model's own forward and the pipeline layers once on a short probe and refuse the model
            when their logits differ (what its forward adds that lightning_bfpp.hf does not know would otherwise
            train a different model, silently). A model on the meta device is not checked (a warning says so).
        pretrained: a directory written by ``save_pretrained`` whose weights fill `model`, built on the meta device:
            under bfpp each rank reads only its own stages' tensors; under other strategies ``configure_model`` reads
            them all. ``CausalLM.from_pretrained(path)`` builds such a model.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
        check: bool = True,
        pretrained: str | os.PathLike | None = None,
    ):
        super().__init__()
        on_meta = any(p.is_meta for p in model.parameters())
        if pretrained is not None and not on_meta:
            raise ValueError(f"CausalLM(pretrained={str(pretrained)!r}) fills a model built on the meta device; this "
                             f"{type(model).__name__} holds weights already: use CausalLM.from_pretrained(path).")
        # the stored tensors, read per module when bfpp (or configure_model) materializes it
        self.__dict__["_weights"] = (SafetensorsWeights(Path(pretrained), stored_names(model))
                                     if pretrained is not None else None)
        own = [n for n, _ in model.named_parameters(recurse=False)] + [n for n, _ in model.named_buffers(recurse=False)]
        if own:
            raise ValueError(f"{type(model).__name__} holds {own[0]} directly; CausalLM adopts its submodules only.")
        for name, child in model.named_children():
            if hasattr(self, name):
                raise ValueError(f"{type(model).__name__}.{name} clashes with LightningModule.{name}: wrap the model yourself.")
            self.add_module(name, child)
        self.__dict__["hf_model"] = model  # unregistered: its modules are registered above, under their own names
        self.__dict__["_layers"] = causal_lm_layers(model)
        self._optimizer = optimizer
        if getattr(model.config, "output_router_logits", False):
            rank_zero_warn(f"CausalLM: {type(model).__name__} has output_router_logits=True, but its router's auxiliary "
                           "loss is not part of pipeline_loss (only the cross-entropy is trained).")
        _check_meta_buffers(model)
        if check and on_meta:
            rank_zero_warn(f"CausalLM: {type(model).__name__} is on the meta device: its layers are not checked against its forward.")
        elif check:
            check_layers_reproduce(model, self.pipeline_forward)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike,
                        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
                        **hf_kwargs: Any) -> CausalLM:
        """The ``*ForCausalLM`` saved in `name_or_path` (a local directory; a hub name where the network allows),
        built on the meta device: no process holds the whole model. Under bfpp each rank reads only its own stages'
        tensors from the safetensors files; under other strategies ``configure_model`` reads them all. `hf_kwargs`:
        config fields, ``attn_implementation``, ``dtype``, ``trust_remote_code``, ``revision``, ``token``,
        ``cache_dir``, ``subfolder``, as for Hugging Face's own; the default dtype is torch's default (fp32, or what
        ``trainer.init_module()`` sets), not the file's (``dtype="auto"``): stored bf16 weights train as fp32 master
        weights under ``precision="bf16-mixed"``. A parameter the files do not store under the model's names (nor
        a tied or base-model name) is an error: transformers' key renaming at load is not applied.
        The layers are not checked against the model's forward (``CausalLM(model)`` checks a model in memory)."""
        hub = {k: hf_kwargs.pop(k) for k in HUB_KWARGS if k in hf_kwargs}
        directory = local_directory(name_or_path, hub, bool(hf_kwargs.get("trust_remote_code")))
        return cls(build_on_meta(directory, hf_kwargs), optimizer=optimizer, check=False, pretrained=directory)

    def pipeline_init_weights(self, name: str, module: nn.Module) -> None:
        """Read `module`'s tensors from the pretrained files, or initialize them as the Hugging Face class does."""
        prefix, weights = f"{name}." if name else "", self._weights
        if weights is None or not weights.stores_all(prefix, module):
            self.hf_model._init_weights(module)
            if hasattr(module, "rope_init_fn") and hasattr(module, "inv_freq"):  # transformers 4.x: not in _init_weights
                module.inv_freq.copy_(module.rope_init_fn(module.config, module.inv_freq.device)[0])
                module.original_inv_freq = module.inv_freq
        if weights is not None:
            weights.load(prefix, module)
            if weights.missing:
                warnings.warn(f"CausalLM.from_pretrained: buffers {weights.missing} not stored in {weights.directory}: "
                              f"initialized as {type(self.hf_model).__name__} initializes them.")
                weights.missing.clear()

    def configure_model(self) -> None:
        """Outside bfpp (which materializes each rank's own stages), a model built on the meta device is filled
        here, whole: from the pretrained files, else as bfpp would initialize it in one process."""
        if not getattr(self.trainer.strategy, "materializes_meta_stages", False) and has_meta_tensors(self):
            seeded_init(self, device=self.trainer.strategy.root_device, only_meta=True)

    def pipeline_layers(self) -> list[nn.Module]:
        return self._layers

    def pipeline_side_inputs(self, input_ids: torch.Tensor) -> dict[str, Any]:
        return causal_lm_side_inputs(self.hf_model, input_ids)

    def pipeline_tp_plan(self, layer_name: str, layer: nn.Module, tensor_parallel: int,
                         sequence_parallel: bool = False) -> dict[str, Any] | None:
        """The model's own tensor-parallel plan (``base_model_tp_plan`` and ``lm_head``), translated to torch's
        styles: attention by heads (tp must divide the query and key/value heads), MLP by hidden units, untied
        embedding and head by vocabulary; with `sequence_parallel`, norms on sequence shards between them. Override
        it to split a model otherwise."""
        return hf_layer_plan(self.hf_model, layer, tensor_parallel, sequence_parallel)

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.pipeline_forward(input_ids)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, targets = batch
        loss = self.pipeline_loss(self(input_ids), targets)
        self.log("train_loss", loss, sync_dist=True)  # the global batch's mean, as bfpp logs it
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        input_ids, targets = batch
        self.log("val_loss", self.pipeline_loss(self(input_ids), targets), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The logits of a batch of input ids, or of (input_ids, targets) pairs (under every strategy)."""
        return self(self.pipeline_inputs(batch)[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self._optimizer is not None:
            return self._optimizer(self.parameters())
        return torch.optim.AdamW(self.parameters(), lr=3e-4)
