# Scope: a Hugging Face model's own tensor-parallel plan (its ``_tp_plan``: the config's ``base_model_tp_plan``
# under the base model's name, plus ``lm_head``) as lightning_bfpp's per-layer plans (torch ParallelStyles by
# submodule name, ``layout.tensor_parallel``), for ``CausalLM.pipeline_tp_plan``. Names are kept: the split
# modules are the model's own, so an export still loads into the Hugging Face class.
from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatch
from typing import Any

from torch import nn

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


def hf_layer_plan(model: nn.Module, layer: nn.Module, tensor_parallel: int) -> dict[str, Any] | None:
    """`layer`'s plan from `model`'s own ``_tp_plan``: each of the layer's submodules (or the layer itself, key "")
    whose name in `model` matches a plan entry gets that entry's style. A weight tied between the embedding and
    ``lm_head`` stays whole (a tied weight cannot be split). An entry with a style not in ``torch_styles()`` is refused."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    name = type(model).__name__
    if not plan:
        raise ValueError(
            f"tensor_parallel={tensor_parallel}: {name} has no tensor-parallel plan (its config has no "
            "base_model_tp_plan; GPT-2 is one such model). Use tensor_parallel=1, or subclass CausalLM and return "
            "each layer's plan from pipeline_tp_plan (README: Tensor parallel)."
        )
    check_heads(model, tensor_parallel)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    names = {id(m): n for n, m in model.named_modules()}
    styles = torch_styles()
    out: dict[str, Any] = {}
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
            out[sub_name] = styles[style]()
    return out or None
