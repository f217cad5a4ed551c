"""Hugging Face causal language models (GPT-2, and the Llama family: any model whose config has a
`base_model_pp_plan`) as a pipelinable LightningModule, ``CausalLM``, that keeps the model's own parameter names. Its
layers come from ``layers``, what the model's own forward adds around them (position ids, rotary cos/sin, masks) from
``side_inputs``; it checks once, at construction, that the layers reproduce the model's own logits
(``wrap_checks``), and refuses a model they do not. Needs `pip install lightning-bfpp[hf]`; nothing is downloaded."""
from __future__ import annotations

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

from ..checkpoint.hf_dir import HF_RECORD, hf_record
from ..contract.hooks import PipelineHooks, mean_loss
from ..contract.router_loss import load_balancing_loss, router_loss, step_aux_loss
from ..contract.step_totals import active_step_totals
from ..layout.materialize import has_meta_tensors, seeded_init
from . import lora
from .cp_attention import splits_sequence
from .layers import causal_lm_layers
from .pretrained import HUB_KWARGS, SafetensorsWeights, build_on_meta, local_directory, stored_names
from .routing import routed_layers, router_coef
from .side_inputs import causal_lm_side_inputs
from .tp_plan import hf_layer_plan
from .wrap_checks import check_layers_reproduce, check_meta_buffers, check_router_loss


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy of the targets that are not -100, their number), in float32 at least (bf16 logits in
    float32, float64 ones as they are)."""
    targets = targets.flatten()
    logits = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    return loss, (targets != -100).sum()


class CausalLM(PipelineHooks, LightningModule):
    """A Hugging Face ``*ForCausalLM`` as a pipelinable LightningModule, with the model's own state-dict keys.

    The model's top-level modules (``transformer``/``model``, ``lm_head``) are registered on this module itself,
    so ``state_dict()`` and checkpoints exported with ``python -m lightning_bfpp.checkpoint`` load into the plain
    Hugging Face class with ``load_state_dict(strict=True)``. Batches are ``(input_ids, targets)`` with targets
    already shifted (the next token; -100 is ignored), or token batches {"input_ids", "labels", "document_ids"}
    (``lightning_bfpp.contract.documents``: a window packing documents, each attending only within itself).
    Tied embeddings become one copy per stage, kept identical.

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
        wrapper, model = model, lora.unwrap(model)  # a PeftModel: its modules adopted, the model it wraps cut
        on_meta = any(p.is_meta for p in model.parameters())
        if pretrained is not None and not on_meta:
            raise ValueError(f"CausalLM(pretrained={str(pretrained)!r}) fills a model built on the meta device; this "
                             f"{type(model).__name__} holds weights already: use CausalLM.from_pretrained(path).")
        # the stored tensors, read per module when bfpp (or configure_model) materializes it
        peft = wrapper is not model
        self.__dict__["_weights"] = (SafetensorsWeights(Path(pretrained), stored_names(model), model,
                                                        plain=lora.plain_name if peft else None)
                                     if pretrained is not None else None)
        self.__dict__["peft_model"] = wrapper if peft else None  # its peft_config, save_pretrained of the adapters
        self.__dict__["_adapter_parts"] = lora.adapter_parts(model) if peft else {}
        self.__dict__["_lora_layers"] = {id(layer) for layer in self._adapter_parts.values()}
        own = [n for n, _ in wrapper.named_parameters(recurse=False)]
        own += [n for n, _ in wrapper.named_buffers(recurse=False)]
        if own:
            raise ValueError(f"{type(wrapper).__name__} holds {own[0]} directly; CausalLM adopts its submodules only.")
        for name, child in wrapper.named_children():
            if hasattr(self, name):
                raise ValueError(f"{type(wrapper).__name__}.{name} clashes with LightningModule.{name}: wrap the model "
                                 "yourself.")
            self.add_module(name, child)
        self.__dict__["hf_model"] = model  # unregistered: its modules are registered above, under their own names
        layers = causal_lm_layers(model)
        self._router_coef = router_coef(model)  # output_router_logits=True: the router loss is trained (hf.routing)
        self.__dict__["_layers"] = routed_layers(layers, model) if self._router_coef is not None else layers
        self.__dict__["_router_totals"] = None  # the last pipeline step's totals (its router statistics)
        self.pipeline_uses_step_totals = self._router_coef is not None
        if self._router_coef is not None:
            self.pipeline_step_logs = self._log_router_loss
        self._optimizer = optimizer
        self.tokenizer: str | None = None  # the run's tokenizer (a directory or name), recorded in checkpoints
        check_meta_buffers(model)
        if check and on_meta:
            rank_zero_warn(f"CausalLM: {type(model).__name__} is on the meta device: its layers are not checked "
                           "against its forward.")
        elif check:
            check_layers_reproduce(model, self.pipeline_forward)
            if self._router_coef is not None:
                check_router_loss(model, self.pipeline_forward, self._layers[-1])

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike,
                        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
                        lora: Any = None, **hf_kwargs: Any) -> CausalLM:
        """The ``*ForCausalLM`` saved in `name_or_path` (a local directory; a hub name where the network allows),
        built on the meta device: no process holds the whole model. Under bfpp each rank reads only its own stages'
        tensors from the safetensors files; under other strategies ``configure_model`` reads them all. `hf_kwargs`:
        config fields, ``attn_implementation``, ``dtype``, ``trust_remote_code``, ``revision``, ``token``,
        ``cache_dir``, ``subfolder``, as for Hugging Face's own; the default dtype is torch's default (fp32, or what
        ``trainer.init_module()`` sets), not the file's (``dtype="auto"``): stored bf16 weights train as fp32 master
        weights under ``precision="bf16-mixed"``. Stored keys are converted as the installed transformers converts them
        at load (renamed keys, experts stored one per key and fused in the model); a parameter the files do not store
        (under its name, a tied or base-model name, or keys converted into it) is an error.
        The layers are not checked against the model's forward (``CausalLM(model)`` checks a model in memory).
        `lora`: a ``peft.LoraConfig``: LoRA adapters on the saved model (``get_peft_model``), initialized as PEFT
        initializes them; only they train."""
        hub = {k: hf_kwargs.pop(k) for k in HUB_KWARGS if k in hf_kwargs}
        directory = local_directory(name_or_path, hub, bool(hf_kwargs.get("trust_remote_code")))
        model = build_on_meta(directory, hf_kwargs)
        if lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, lora)
        return cls(model, optimizer=optimizer, check=False, pretrained=directory)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the model's config, its LoRA configs and the run's tokenizer (``tokenizer``, a directory or name,
        when the run read text with one) in the checkpoint: ``python -m lightning_bfpp.checkpoint CKPT --hf DIR``
        then writes a Hugging Face directory."""
        peft = self.peft_model.peft_config if self.peft_model is not None else None
        base = self._weights.directory.resolve() if self._weights is not None else None
        checkpoint[HF_RECORD] = hf_record(self.hf_model.config, peft, self.tokenizer, base)

    def pipeline_init_weights(self, name: str, module: nn.Module) -> None:
        """Read `module`'s tensors from the pretrained files, or initialize them as the Hugging Face class does (LoRA
        adapters as PEFT does)."""
        if id(module) in self._adapter_parts:
            return  # initialized with its LoRA layer, next
        if id(module) in self._lora_layers:
            lora.init_adapters(module, self.peft_model.peft_config)
        prefix, weights = f"{name}." if name else "", self._weights
        if weights is None or not weights.stores_all(prefix, module):
            self.hf_model._init_weights(module)
            # transformers 4.x: rotary frequencies are not in _init_weights
            if hasattr(module, "rope_init_fn") and hasattr(module, "inv_freq"):
                module.inv_freq.copy_(module.rope_init_fn(module.config, module.inv_freq.device)[0])
                module.original_inv_freq = module.inv_freq
        if weights is not None:
            weights.load(prefix, module)
            if weights.missing:
                warnings.warn(f"CausalLM.from_pretrained: buffers {weights.missing} not stored in {weights.directory}: "
                              f"initialized as {type(self.hf_model).__name__} initializes them.", stacklevel=1)
                weights.missing.clear()

    def configure_model(self) -> None:
        """Outside bfpp (which materializes each rank's own stages), a model built on the meta device is filled
        here, whole: from the pretrained files, else as bfpp would initialize it in one process."""
        if not getattr(self.trainer.strategy, "materializes_meta_stages", False) and has_meta_tensors(self):
            seeded_init(self, device=self.trainer.strategy.root_device, only_meta=True)

    def pipeline_layers(self) -> list[nn.Module]:
        return self._layers

    def pipeline_side_inputs(self, inputs: Any) -> dict[str, Any]:
        """Position ids, rotary cos/sin and the attention mask of `inputs`: input ids, or (input ids, document ids) of
        a window packing several documents (positions restart at each, attention stays within it)."""
        return causal_lm_side_inputs(self.hf_model, inputs)

    def pipeline_tp_plan(self, layer_name: str, layer: nn.Module, tensor_parallel: int,
                         sequence_parallel: bool = False) -> dict[str, Any] | None:
        """The model's own tensor-parallel plan (``base_model_tp_plan`` and ``lm_head``), translated to torch's
        styles: attention by heads (tp must divide the query and key/value heads), MLP by hidden units, untied
        embedding and head by vocabulary; with `sequence_parallel`, norms on sequence shards between them. Override
        it to split a model otherwise."""
        return hf_layer_plan(self.hf_model, layer, tensor_parallel, sequence_parallel)

    def pipeline_context_parallel(self, layer_name: str, layer: nn.Module, context_parallel: int) -> bool:
        """Every layer runs on a shard of each sequence when the model attends through transformers' attention
        interface: bfpp then routes it through its own attention function (``hf.cp_attention``), the model's own
        implementation outside context parallel. Raises naming why a decoder layer cannot."""
        return splits_sequence(self.hf_model, layer)

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed cross-entropy, counted targets): targets of -100 are ignored, and bfpp trains the mean over the
        global batch's counted targets, as one process on that batch (``mean_loss`` gives a batch's mean). With
        ``output_router_logits=True`` the sum also holds ``router_aux_loss_coef x aux_loss x counted targets``: the
        mean is the model's own loss (``hf.routing``)."""
        loss, items = cross_entropy_sum(logits, targets)
        if self._router_coef is not None:
            self.__dict__["_router_totals"] = active_step_totals()
            loss = loss + router_loss(self._layers[-1].last_stats, items, self._router_coef)
        return loss, items

    def _log_router_loss(self) -> None:
        """``pipeline_step_logs`` of a routed model: the router loss the step trained (``train_aux_loss``)."""
        if self._router_totals is not None:
            self.log("train_aux_loss", step_aux_loss(self._router_totals))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Logits of input ids, or of (input ids, document ids): ``self(x)`` or ``self(*x)``."""
        return self.pipeline_forward(inputs[0] if len(inputs) == 1 else inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = self.pipeline_inputs(batch)
        loss_sum, items = cross_entropy_sum(self(inputs), targets)
        self.log("train_loss", loss_sum / items, sync_dist=True)  # the global batch's mean, as bfpp logs it
        if self._router_coef is not None:
            aux = load_balancing_loss(self._layers[-1].last_stats)
            self.log("train_aux_loss", aux, sync_dist=True)
            loss_sum = loss_sum + self._router_coef * aux * items
        return loss_sum / items

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = self.pipeline_inputs(batch)
        self.log("val_loss", mean_loss(cross_entropy_sum(self(inputs), targets)), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The logits of a batch of input ids, or of (input_ids, targets) pairs (under every strategy)."""
        return self(self.pipeline_inputs(batch)[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The optimizer of the parameters that train (with LoRA: the adapters; the frozen weights take no state)."""
        params = [p for p in self.parameters() if p.requires_grad]
        if self._optimizer is not None:
            return self._optimizer(params)
        return torch.optim.AdamW(params, lr=3e-4)
