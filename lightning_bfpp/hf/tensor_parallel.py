"""A Hugging Face model's own tensor-parallel plan (its ``_tp_plan``: the config's ``base_model_tp_plan``
under the base model's name, plus ``lm_head``) as lightning_bfpp's per-layer plans (torch ParallelStyles by
submodule name, ``layout.tensor_parallel``), for ``CausalLM.pipeline_tp_plan``. Names are kept: the split
modules are the model's own, so an export still loads into the Hugging Face class."""
from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatch
from typing import Any

from torch import nn

from ..layout.tensor_parallel import (
    SEQUENCE_DIM,
    sequence_gather,
    sequence_parallel_norm,
    sequence_scatter,
    shared_input,
)


def torch_styles() -> dict[str, Callable[[], Any]]:
    """The Hugging Face plan styles lightning_bfpp translates, each as torch's style; every layer's output stays
    whole (replicated), as between pipeline stages."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel,  # output split by heads / hidden units, consumed by a rowwise module
        "rowwise": RowwiseParallel,  # input split, output summed over the tp group
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),  # lm_head: logits gathered
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocabulary rows, lookups summed
    }


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


def hf_layer_plan(model: nn.Module, layer: nn.Module, tensor_parallel: int,
                  sequence_parallel: bool = False) -> dict[str, Any] | None:
    """`layer`'s plan from `model`'s own ``_tp_plan``: each of the layer's submodules (or the layer itself, key "")
    whose name in `model` matches a plan entry gets that entry's style. A weight tied between the embedding and
    ``lm_head`` stays whole (a tied weight cannot be split). An entry with a style not in ``torch_styles()`` is
    refused. `sequence_parallel`: the same split, with sequence shards between the split modules (``sp_plan``)."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    name = type(model).__name__
    if not plan:
        raise ValueError(
            f"tensor_parallel={tensor_parallel}: {name} has no tensor-parallel plan (its config has no "
            "base_model_tp_plan; GPT-2 is one such model). Use tensor_parallel=1, or subclass CausalLM and return "
            "each layer's plan from pipeline_tp_plan (docs/tensor_parallel.md)."
        )
    check_heads(model, tensor_parallel)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    names = {id(m): n for n, m in model.named_modules()}
    styles = torch_styles()
    kinds: dict[str, str] = {}  # submodule name in `layer` -> its Hugging Face style
    for sub_name, sub in layer.named_modules():
        full = names.get(id(sub))
        if full is None or (tied and sub in (head, embedding)):
            continue
        for pattern, style in plan.items():
            if not fnmatch(full, pattern):
                continue
            if style not in styles:
                raise ValueError(
                    f"tensor_parallel={tensor_parallel}: {name}'s tensor-parallel plan splits {full} as {style!r}, "
                    f"which lightning_bfpp cannot translate (it knows {', '.join(styles)}). Use tensor_parallel=1, "
                    "or subclass CausalLM and return this layer's plan from pipeline_tp_plan."
                )
            kinds[sub_name] = style
    kind = "input" if any(m is embedding for m in layer.modules()) else \
        "output" if any(m is head for m in layer.modules()) else "decoder"
    plan = {sub: styles[style]() for sub, style in kinds.items()}
    if sequence_parallel:
        return sp_plan(model, layer, kinds, kind, plan)
    if kind == "decoder" and plan:  # attention and MLP hand their input to q/k/v (gate/up) as one replicated tensor
        plan.update({parent: shared_input() for parent in _readers(model, kinds, required=False)})
    return plan or None


def _readers(model: nn.Module, kinds: dict[str, str], required: bool = True) -> set[str]:
    """The modules whose children are the column-wise projections (attention, MLP): they read the residual stream.
    Projections not grouped that way: none (not `required`: each projection then all-reduces its own input
    gradient, as torch's ColwiseParallel does), or an error."""
    readers = {sub.rpartition(".")[0] for sub, style in kinds.items() if style == "colwise"}
    if "" in readers or len({r.rpartition(".")[0] for r in readers}) != 1:
        if not required:
            return set()
        raise ValueError(
            f"sequence_parallel=True: {type(model).__name__}'s decoder layer has column-wise projections "
            f"{sorted(kinds)} that are not grouped under attention and MLP modules, so there is no module to gather "
            "the sequence for; use sequence_parallel=False, or subclass CausalLM and return its plan from "
            "pipeline_tp_plan."
        )
    return readers


def sp_plan(model: nn.Module, layer: nn.Module, kinds: dict[str, str], kind: str,
            plan: dict[str, Any]) -> dict[str, Any]:
    """The sequence-parallel plan of one pipeline layer, from its submodules' Hugging Face styles (`kinds`) and their
    translation without sequence parallel (`plan`). The
    input layer's output is cut to this rank's sequence shard (a row-wise embedding reduce-scatters its lookups);
    the output layer gathers the sequence first. In a decoder layer the parents of the column-wise projections
    (attention, MLP) gather the sequence, the row-wise projections reduce-scatter it back, and the layer's other
    weighted children, its norms, run on the shard; any other weighted child is refused (it would see a shard)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    out = dict(plan)
    to_shard = RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM))
    if kind == "input":
        if kinds.get("") == "embedding_rowwise":  # the layer is the embedding: its lookups summed into shards
            return {"": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(SEQUENCE_DIM))}
        return {**out, "": sequence_scatter()}
    if kind == "output":
        return {**out, "": sequence_gather(use_local_output=True)}
    where = f"sequence_parallel=True: {type(model).__name__}'s decoder layer"
    gathered = _readers(model, kinds)
    decoder = next(iter(gathered)).rpartition(".")[0]
    prefix = f"{decoder}." if decoder else ""
    for child_name, child in layer.get_submodule(decoder).named_children():
        sub = prefix + child_name
        if sub in gathered or next(child.parameters(), None) is None:
            continue
        if "norm" not in type(child).__name__.lower():
            raise ValueError(f"{where} has {child_name} ({type(child).__name__}), which is neither a norm nor split "
                             "by the model's plan: on a sequence shard it would not see the whole sequence. Use "
                             "sequence_parallel=False.")
        out[sub] = sequence_parallel_norm()
    out.update({sub: to_shard for sub, style in kinds.items() if style == "rowwise"})
    return {**out, **{sub: sequence_gather() for sub in gathered}}
