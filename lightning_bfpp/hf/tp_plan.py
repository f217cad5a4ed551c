"""A Hugging Face model's own tensor-parallel plan (its ``_tp_plan``: the config's ``base_model_tp_plan`` under the base
model's name, plus ``lm_head``) as lightning_bfpp's per-layer plans (torch ParallelStyles by submodule name,
``layout.tensor_parallel`` and ``layout.tp_styles``), for ``CausalLM.pipeline_tp_plan``. Names are kept: the split
modules are the model's own, so an export still loads into the Hugging Face class.

Every style of transformers' dense and attention plans is translated (``STYLES``); mixture-of-experts styles keep the
experts whole on every tensor-parallel rank (expert parallel splits them: ``layout.experts``). A block of a decoder
layer (attention, MLP) whose weights are all split is "split"; one holding weights the plan keeps whole (a router,
experts, a norm over a gathered projection, a latent projection) is computed whole where its input is whole."""
from __future__ import annotations

from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn

from ..contract.layer_io import LayerCall
from ..layout.tensor_parallel import (
    SEQUENCE_DIM,
    sequence_gather,
    sequence_parallel_norm,
    sequence_scatter,
    shared_input,
)
from ..layout.tp_styles import (
    combined,
    elementwise,
    latent_projection,
    local_parameters,
    replicated_parameters,
    sharded_norm,
    summed_grad_parameters,
    whole_block,
)
from .layers import decoder_stack
from .lora import LORA_AFTER_SUM, LORA_KINDS, LORA_WHOLE_INPUT, lora_kinds
from .side_inputs import causal_lm_side_inputs
from .tp_probe import SHARDED, partial_weights

COLWISE = ("colwise", "unit_colwise", "colwise_gather_output", "colwise_rep")  # read a block's input, split by outputs
ROWWISE = ("rowwise", "unit_rowwise", "rowwise_split_input", "rowwise_rep")  # make a block's output from split inputs
KEPT_WHOLE = ("replicate", "moe_tp_experts", "packed_colwise", "packed_rowwise")  # experts: see layout.experts
STYLES = (*COLWISE, *ROWWISE, "embedding_rowwise", "embedding_colwise", "replicated_with_grad_allreduce",
          "mla_kv_a_proj", "local_params", *KEPT_WHOLE)
# a block's split weights (and LoRA adapters, split or computed with their projection: hf.lora)
HANDLED = (*COLWISE, *ROWWISE, "embedding_rowwise", "embedding_colwise", "local_params", *LORA_KINDS)


def check_heads(model: nn.Module, tensor_parallel: int) -> None:
    """Each tp rank computes whole query and key/value heads: tp must divide both counts (GQA included)."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads is None or (heads % tensor_parallel == 0 and kv % tensor_parallel == 0):
        return
    fits = [t for t in range(1, heads + 1) if heads % t == 0 and kv % t == 0]
    raise ValueError(
        f"tensor_parallel={tensor_parallel} must divide {type(model).__name__}'s num_attention_heads={heads} and "
        f"num_key_value_heads={kv} (each tensor-parallel rank computes whole query and key/value heads); use "
        f"tensor_parallel in {fits}."
    )


def _torch_style(style: str, module: nn.Module, sequence_shards: bool, params: dict[str, str], config: Any) -> Any:
    """torch's style for a module the Hugging Face plan gives `style` (None: kept whole). `sequence_shards`: a
    row-wise projection hands on sequence shards (reduce-scatter), else the whole output (all-reduce). `params`: its
    own parameters split by plan entries of their own (``local_params``). `config`: the model's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = Shard(SEQUENCE_DIM) if sequence_shards else Replicate()
    if style in ("colwise", "unit_colwise"):  # unit_*: whole heads per rank, as check_heads requires
        return ColwiseParallel()
    if style in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Replicate())
    if style in ("rowwise", "unit_rowwise"):
        return RowwiseParallel(output_layouts=out)
    if style in ("rowwise_split_input", "rowwise_rep"):  # its input whole on every rank: each takes its own features
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
    if style == "embedding_rowwise":  # vocabulary rows, lookups summed
        return RowwiseParallel(input_layouts=Replicate())
    if style == "embedding_colwise":  # embedding features, gathered
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "replicated_with_grad_allreduce":
        return sharded_norm()
    if style == "mla_kv_a_proj":
        return latent_projection(config.qk_rope_head_dim)  # the rotary key, shared by every head
    if style == "local_params":
        return local_parameters({p: Shard(max(getattr(module, p).dim() - 2, 0)) for p in params})
    if style == LORA_WHOLE_INPUT:
        return replicated_parameters()
    if style == LORA_AFTER_SUM and sequence_shards:
        return summed_grad_parameters([n for n, _ in module.named_parameters(recurse=False)])
    return None


class _Plan:
    """One layer's Hugging Face styles: `kinds` {submodule name in the layer: style}, `params` {submodule name:
    {own parameter: style}} (plan entries naming parameters)."""

    def __init__(self, model: nn.Module, layer: nn.Module, tensor_parallel: int):
        self.model, self.layer, self.tp = model, layer, tensor_parallel
        self.name = type(model).__name__
        plan = dict(getattr(model, "_tp_plan", None) or {})
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        tied = head is not None and embedding is not None and head.weight is embedding.weight
        names = {id(m): n for n, m in model.named_modules()}
        self.kinds: dict[str, str] = {}
        self.params: dict[str, dict[str, str]] = {}
        for sub_name, sub in layer.named_modules():
            full = names.get(id(sub))
            if full is None or (tied and sub in (head, embedding)):
                continue
            for pattern, style in plan.items():
                if fnmatch(full, pattern):
                    self.kinds[sub_name] = self._known(style, full)
                for p_name, _ in sub.named_parameters(recurse=False):
                    if fnmatch(f"{full}.{p_name}", pattern):
                        self.params.setdefault(sub_name, {})[p_name] = self._known(style, f"{full}.{p_name}")
        # LoRA-adapted projections: the style moves onto the base layer and the adapters (hf.lora)
        self.kinds, self.lora_of = lora_kinds(layer, self.kinds, COLWISE, ROWWISE) if self.kinds else ({}, {})
        for sub_name, own in self.params.items():
            if self.kinds.get(sub_name) != "local_params":
                p_name, style = next(iter(own.items()))
                raise ValueError(
                    f"tensor_parallel={tensor_parallel}: {self.name}'s tensor-parallel plan splits the parameter "
                    f"{names[id(layer.get_submodule(sub_name))]}.{p_name} as {style!r}, but not its module's forward "
                    "as 'local_params', so lightning_bfpp cannot tell how the module uses it. Use tensor_parallel=1, "
                    "or subclass CausalLM and return this layer's plan from pipeline_tp_plan."
                )
        self.kind = "input" if any(m is embedding for m in layer.modules()) else \
            "output" if any(m is head for m in layer.modules()) else "decoder"
        self.summed: dict[str, list[str]] = {}  # submodule -> its own weights kept whole, their gradients summed
        if self.kind == "decoder":
            self._follow_whole_weights()

    def _follow_whole_weights(self) -> None:
        """Find the weights the plan keeps whole inside a block of heads split by columns that compute with this
        rank's share (``tp_probe``): their gradients are summed over tp; one used both ways is refused."""
        readers = sorted({self.block_of(s) for s, k in self.kinds.items() if k in SHARDED})
        handled = {f"{s}.{p}" if s else p for s in self.kinds if self._split(s) or self.kinds[s] == "mla_kv_a_proj"
                   for p, _ in self.layer.get_submodule(s).named_parameters(recurse=False)
                   if self.kinds[s] != "local_params" or p in self.params.get(s, {})}
        blocks = [r for r in readers
                  if any(n not in handled for n, _ in self.layer.get_submodule(r).named_parameters(prefix=r))]
        if not blocks:
            return
        try:
            partial, both = partial_weights(self.layer, self.kinds, self.params, blocks, handled, self._probe)
        except Exception as err:  # a layer that cannot run alone: say which
            raise ValueError(
                f"tensor_parallel={self.tp}: {self.name}'s plan keeps weights of {blocks} whole beside projections "
                f"split by heads, and lightning_bfpp could not follow the layer on 4 tokens to tell whether "
                f"they compute with this rank's heads ({type(err).__name__}: {err}). Use tensor_parallel=1, or "
                "subclass CausalLM and return this layer's plan from pipeline_tp_plan."
            ) from err
        if both:
            raise ValueError(
                f"tensor_parallel={self.tp}: {self.name}'s plan keeps {sorted(both)[0]} whole, and it computes both "
                "with this rank's share of a split projection and with whole tensors, so no sum of its gradient over "
                "tensor-parallel ranks is the gradient of one process. Use tensor_parallel=1, or subclass CausalLM "
                "and return this layer's plan from pipeline_tp_plan."
            )
        for name in sorted(partial):
            owner, _, own = name.rpartition(".")
            self.summed.setdefault(owner, []).append(own)

    def block_of(self, sub: str) -> str:
        """The block holding projection `sub` (a LoRA-adapted projection's parts: the projection's block)."""
        return self.lora_of.get(sub, sub).rpartition(".")[0]

    def _probe(self, values: dict[str, torch.Tensor], device: torch.device) -> None:
        """One call of the layer with `values` for its weights and buffers, on a 4-token sequence on `device` with
        the side inputs the model's forward makes."""
        from torch.func import functional_call

        buffers = [b for b in self.model.buffers() if not b.is_meta]
        ids = torch.zeros(1, 4, dtype=torch.long, device=buffers[0].device if buffers else "meta")
        side = _moved(causal_lm_side_inputs(self.model, ids), device)
        dtype = next(self.layer.parameters()).dtype
        hidden = torch.linspace(-1, 1, 4 * self.model.config.hidden_size, device=device, dtype=dtype)
        hidden = hidden.view(1, 4, -1)
        args, kwargs = LayerCall(self.layer, "probe").arguments(hidden, side)
        functional_call(self.layer, values, args, kwargs, strict=False)

    def _known(self, style: str, where: str) -> str:
        if style not in STYLES:
            raise ValueError(
                f"tensor_parallel={self.tp}: {self.name}'s tensor-parallel plan splits {where} as {style!r}, which "
                f"lightning_bfpp cannot translate (it knows {', '.join(STYLES)}). Use tensor_parallel=1, or subclass "
                "CausalLM and return this layer's plan from pipeline_tp_plan."
            )
        return style

    def under(self, block: str) -> dict[str, str]:
        """The styles of `block` and its submodules."""
        return {s: k for s, k in self.kinds.items() if s == block or s.startswith(f"{block}.") or not block}

    def whole(self, block: str) -> bool:
        """Whether `block` holds weights the plan keeps whole (or splits only by a norm's or a latent projection's
        own rule): then it is computed whole where its input is whole."""
        prefix = f"{block}." if block else ""
        for sub_name, sub in self.layer.get_submodule(block).named_modules():
            full = prefix + sub_name if sub_name else block
            if next(sub.parameters(recurse=False), None) is not None and not self._split(full):
                return True
        return False

    def _split(self, sub: str) -> bool:
        """Whether the plan splits `sub`'s own weights, or computes them on this rank's heads (a norm over them, or
        weights whose gradients are summed)."""
        style = self.kinds.get(sub)
        return style in HANDLED or style == "replicated_with_grad_allreduce" and self._reads_split_heads(sub) or \
            sub in getattr(self, "summed", {}) and len(self.summed[sub]) == len(list(
                self.layer.get_submodule(sub).parameters(recurse=False)))

    def styles(self, sequence_shards: set[str]) -> dict[str, Any]:
        """torch's style for every split submodule; row-wise ones under a block in `sequence_shards` reduce-scatter."""
        out = {}
        for sub, style in self.kinds.items():
            if style == "replicated_with_grad_allreduce" and not self._reads_split_heads(sub):
                continue  # a norm over a whole projection: whole on every rank, its gradients too
            shards = any(sub.startswith(f"{block}.") for block in sequence_shards)
            translated = _torch_style(style, self.layer.get_submodule(sub), shards, self.params.get(sub, {}),
                                      self.model.config)
            if translated is not None:
                out[sub] = translated
        for sub, own in self.summed.items():
            out[sub] = combined(out.get(sub), summed_grad_parameters(own))
        return out

    def _reads_split_heads(self, norm: str) -> bool:
        """Whether the norm's block splits its projections by heads (a sibling column-wise projection whose output
        stays split), so that the norm sees this rank's heads."""
        parent = norm.rpartition(".")[0]
        return any(self.block_of(s) == parent and k in ("colwise", "unit_colwise") for s, k in self.kinds.items())


def _moved(value: Any, device: torch.device) -> Any:
    """`value` (side inputs: nested dicts and tuples of tensors) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_moved(v, device) for v in value)
    return value


def hf_layer_plan(model: nn.Module, layer: nn.Module, tensor_parallel: int,
                  sequence_parallel: bool = False) -> dict[str, Any] | None:
    """`layer`'s plan from `model`'s own ``_tp_plan``: each of the layer's submodules (or the layer itself, key "")
    whose name in `model` matches a plan entry gets that entry's style, translated to torch's. A weight tied between
    the embedding and ``lm_head`` stays whole (a tied weight cannot be split). A style lightning_bfpp does not know
    is refused before launch. `sequence_parallel`: the same split, with sequence shards between the blocks."""
    if not getattr(model, "_tp_plan", None):
        raise ValueError(
            f"tensor_parallel={tensor_parallel}: {type(model).__name__} has no tensor-parallel plan (its config has "
            "no base_model_tp_plan; GPT-2 is one such model). Use tensor_parallel=1, or subclass CausalLM and return "
            "each layer's plan from pipeline_tp_plan (docs/tensor_parallel.md)."
        )
    check_heads(model, tensor_parallel)
    plan = _Plan(model, layer, tensor_parallel)
    if sequence_parallel:
        return _sequence_parallel(plan)
    styles = plan.styles(set())
    if plan.kind == "decoder" and styles:  # a split block hands its input to its projections as one replicated tensor
        readers = {plan.block_of(s) for s, k in plan.kinds.items() if k in COLWISE}
        styles.update({r: combined(styles.get(r), shared_input()) for r in readers if r and not plan.whole(r)})
    return styles or None


def _decoder_path(plan: _Plan) -> str:
    """Where the model's own decoder layer sits in the pipeline layer ("" unless wrapped)."""
    stack = {id(m) for m in decoder_stack(plan.model)}
    return next((n for n, m in plan.layer.named_modules() if id(m) in stack), "")


def _blocks(decoder: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The decoder layer's children, those in a ModuleList or ModuleDict (a layer with two attentions) one by one."""
    out = []
    for name, child in decoder.named_children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            out += _blocks(child, f"{prefix}{name}.")
        else:
            out.append((prefix + name, child))
    return out


def _sequence_parallel(plan: _Plan) -> dict[str, Any]:
    """The sequence-parallel plan of one pipeline layer. The input layer's output is cut to this rank's sequence
    shard (a row-wise embedding reduce-scatters its lookups); the output layer gathers the sequence first. In a
    decoder layer each block gathers the sequence: a split block as one replicated tensor for its column-wise
    projections, its row-wise projections reduce-scattering it back; a block computed whole as a plain tensor, its
    output cut back to this rank's shard. The layer's norms run on the shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    styles = plan.styles(set())
    if plan.kind == "input":
        if plan.kinds.get("") == "embedding_rowwise":  # the layer is the embedding: its lookups summed into shards
            return {"": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(SEQUENCE_DIM))}
        return {**styles, "": sequence_scatter()}
    if plan.kind == "output":
        return {**styles, "": sequence_gather(use_local_output=True)}
    if all(isinstance(m, nn.Dropout) for m in plan.layer.modules()):
        return {"": elementwise()}  # e.g. the embedding's dropout, a layer of its own in the pipeline plan
    decoder = _decoder_path(plan)
    prefix = f"{decoder}." if decoder else ""
    blocks: dict[str, Any] = {}
    split: set[str] = set()  # blocks whose row-wise projections reduce-scatter
    for child_name, child in _blocks(plan.layer.get_submodule(decoder)):
        block = prefix + child_name
        if next(child.parameters(), None) is None:
            continue
        if plan.kinds.get(block, "local_params") != "local_params":  # a projection straight under the layer
            raise ValueError(
                f"sequence_parallel=True: {plan.name}'s decoder layer has {child_name} ({type(child).__name__}) split "
                f"as {plan.kinds[block]!r} by the model's plan, outside an attention or MLP block that could gather "
                "the sequence for it. Use sequence_parallel=False, or subclass CausalLM and return its plan from "
                "pipeline_tp_plan."
            )
        if not plan.under(block) and "norm" in type(child).__name__.lower():
            blocks[block] = sequence_parallel_norm(local_output=True)
        elif plan.whole(block):
            blocks[block] = whole_block()
        else:
            blocks[block] = sequence_gather()
            split.add(block)
    styles = plan.styles(split)
    return {**styles, **{b: combined(styles.get(b), style) for b, style in blocks.items()}}
