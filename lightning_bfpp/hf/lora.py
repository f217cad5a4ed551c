"""LoRA adapters (PEFT's ``get_peft_model``) through the pipeline. ``CausalLM`` takes a ``PeftModel`` as it takes a
Hugging Face model: it adopts the PEFT wrapper's modules (checkpoints keep PEFT's names,
``base_model.model.<hf name>``, adapters ``...q_proj.lora_A.default.weight``) and cuts the model PEFT wraps, whose
adapted projections stay where they were, into layers. The base weights are frozen by PEFT: only the adapters take
gradients and optimizer state. The names a pretrained directory stores the base weights under (`plain_name`), the
adapters' own initialization after a build on the meta device (`init_adapters`), their tensor-parallel split
(`lora_kinds`) and the settings the app builds a ``LoraConfig`` from (`lora_config`) live here.
Needs ``pip install lightning-bfpp[hf]`` (peft)."""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn

PREFIX = "base_model.model."  # a PeftModel's name for the model it wraps (its LoraModel's .model)
PARTS = ("lora_A", "lora_B")
SETTINGS = ("r", "alpha", "target_modules", "dropout")  # the app's model.lora fields


def _is(module: nn.Module, name: str) -> bool:
    """Whether `module` is an instance of peft's class `name` (without importing peft)."""
    return any(c.__module__.startswith("peft.") and c.__name__ == name for c in type(module).__mro__)


def is_peft(model: nn.Module) -> bool:
    """Whether `model` is a ``peft.PeftModel``."""
    return _is(model, "PeftModel")


def unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face model a ``PeftModel`` wraps (its adapted projections in place), or `model` itself. Adapters
    other than LoRA, and LoRA on embeddings or convolutions, are refused naming what to change."""
    if not is_peft(model):
        return model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    for name, config in model.peft_config.items():
        kind = getattr(config.peft_type, "value", config.peft_type)
        if kind != "LORA":
            raise ValueError(f"CausalLM: the PeftModel's adapter {name!r} is {kind}; lightning_bfpp trains LoRA "
                             "adapters only (peft.LoraConfig).")
    inner = model.get_base_model()
    for name, module in inner.named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module, LoraLinear):
            raise ValueError(f"CausalLM: LoRA on {name} ({type(module).__name__}); lightning_bfpp adapts linear "
                             "projections only: leave it out of LoraConfig(target_modules=...).")
        if isinstance(module, LoraLinear) and (any(module.use_dora.values()) or module.lora_variant):
            raise ValueError(f"CausalLM: {name} is a LoRA variant (DoRA, ...); lightning_bfpp trains plain LoRA: set "
                             "use_dora=False.")
    return inner


def plain_name(name: str) -> str:
    """A PEFT model's parameter name as a Hugging Face checkpoint of the model stores it: without the wrapper's
    prefix and the adapted projection's ``base_layer`` (``base_model.model.model.layers.0.self_attn.q_proj.base_layer
    .weight`` -> ``model.layers.0.self_attn.q_proj.weight``)."""
    return re.sub(r"\.base_layer(?=\.|$)", "", name.removeprefix(PREFIX))


def adapter_parts(model: nn.Module) -> dict[int, nn.Module]:
    """{id of each LoRA layer's ``lora_A``/``lora_B`` module: the LoRA layer} of `model`."""
    from peft.tuners.lora import LoraLayer

    parts: dict[int, nn.Module] = {}
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for part in PARTS:
                for sub in getattr(module, part).values():
                    parts[id(sub)] = module
    return parts


def init_adapters(layer: nn.Module, configs: Mapping[str, Any]) -> None:
    """Initialize a LoRA layer's adapters as PEFT does when it adds them (`configs`: the PeftModel's ``peft_config``;
    ``init_lora_weights``: A as a linear layer, B zero, by default)."""
    for adapter in layer.lora_A:
        layer.reset_lora_parameters(adapter, configs[adapter].init_lora_weights)


def lora_config(settings: Mapping[str, Any]) -> Any:
    """A ``peft.LoraConfig`` for a causal LM from the app's ``model.lora`` settings: ``r`` (the rank), ``alpha``
    (scale alpha / r; default 2 r), ``target_modules`` (names or a list; default PEFT's per-family choice),
    ``dropout``. An unknown setting or a rank below 1 is an error naming it."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"model.lora.{unknown[0]} is not a LoRA setting; they are {', '.join(SETTINGS)}.")
    r = settings.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"model.lora.r={r!r}: the adapters' rank, a positive integer (e.g. model.lora.r=8).")
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("model.lora needs peft: pip install 'lightning-bfpp[hf]'.") from err
    targets = settings.get("target_modules")
    if targets is not None and not isinstance(targets, str):
        targets = list(targets)
    alpha = settings.get("alpha")
    return LoraConfig(r=r, lora_alpha=2 * r if alpha is None else alpha, target_modules=targets,
                      lora_dropout=float(settings.get("dropout") or 0.0), task_type="CAUSAL_LM")


# The tensor-parallel split of a LoRA-adapted projection (y = base(x) + B(A(x)) x scale), kinds for hf.tp_plan:
# a column-wise base splits B by outputs as well, A kept whole (LORA_WHOLE_INPUT: a replicated DTensor, its gradient
# summed over tp by DTensor, each rank's from its own outputs); a row-wise base splits A by inputs as well (its output
# summed as the base's), B kept whole on the summed output (LORA_AFTER_SUM: under sequence parallel a sequence shard,
# its gradient then summed over tp).
LORA_WHOLE_INPUT, LORA_AFTER_SUM = "lora_whole_input", "lora_after_sum"
LORA_KINDS = (LORA_WHOLE_INPUT, LORA_AFTER_SUM)


def lora_kinds(layer: nn.Module, kinds: dict[str, str], colwise: tuple[str, ...],
               rowwise: tuple[str, ...]) -> tuple[dict[str, str], dict[str, str]]:
    """A layer's Hugging Face styles {submodule: style} with each LoRA-adapted projection's style moved onto its base
    layer and its adapters (split as above), and {each such part: the adapted projection}. A projection the plan
    keeps whole keeps its adapters whole."""
    out: dict[str, str] = {}
    owner: dict[str, str] = {}
    for sub, style in kinds.items():
        module = layer.get_submodule(sub)
        if not _is(module, "LoraLayer") or style not in (*colwise, *rowwise):
            out[sub] = style
            continue
        parts = {f"{sub}.base_layer": style}
        for adapter in module.lora_A:
            a, b = f"{sub}.lora_A.{adapter}", f"{sub}.lora_B.{adapter}"
            parts.update({a: LORA_WHOLE_INPUT, b: style} if style in colwise else {a: style, b: LORA_AFTER_SUM})
        out.update(parts)
        owner.update(dict.fromkeys(parts, sub))
    return out, owner
