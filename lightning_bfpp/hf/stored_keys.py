"""Stored keys as transformers converts them at load: checkpoints whose names or layout differ from the model's
(transformers 5 saves a mixture-of-experts model's fused experts one expert per key; older formats use other names)
are read with the installed transformers' own conversions (``get_model_conversion_mapping``, ``rename_source_key``
and its ``WeightConverter`` operations), one target at a time, so each rank converts only its own stages' tensors."""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class _Source:
    """What makes one of the model's tensors: stored keys (with the converter's source pattern each matched) and the
    converter (None: a renamed key, read as it is)."""

    converter: Any
    keys: list[tuple[str, str]] = field(default_factory=list)


class StoredKeys:
    """The model's parameter and buffer names not stored under their own names, each with the stored keys and the
    conversion transformers applies to make it. Empty with transformers 4 (no load-time conversions)."""

    def __init__(self, model: nn.Module, stored: Iterable[str], plain: Callable[[str], str] | None = None):
        self.model = model
        self.sources: dict[str, _Source] = {}
        self.made_with: dict[str, str] = {}  # a second target of a one-to-many converter -> its first target
        self._made: dict[str, torch.Tensor] = {}
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
        except ImportError:  # transformers 4: checkpoints are stored under the model's names
            return
        # `plain`: the model's names as its checkpoints store them (a LoRA-adapted model: ``hf.lora.plain_name``)
        names = {(plain or str)(k): v for k, v in model.state_dict(keep_vars=True).items()}
        stored = [k for k in stored if k not in names]
        if not stored:
            return
        mapping = get_model_conversion_mapping(model)
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = getattr(model, "base_model_prefix", None)
        for key in sorted(stored, key=dot_natural_key):  # experts in order, as transformers collects them
            target, pattern = rename_source_key(key, renamings, converters, prefix, names)
            if target not in names:
                continue
            converter = by_pattern.get(pattern) if pattern is not None else None
            source = self.sources.setdefault(target, _Source(converter))
            source.keys.append((key, pattern if converter is not None else key))
            if converter is not None:
                for other in converter.target_patterns[1:]:
                    self.made_with[target.replace(converter.target_patterns[0], other)] = target

    def makes(self, name: str) -> bool:
        return name in self.sources or name in self.made_with

    def stored_keys(self, name: str) -> list[str]:
        return [k for k, _ in self.sources[self.made_with.get(name, name)].keys]

    def make(self, name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The model's tensor `name`, from the stored keys `read` returns, converted as transformers converts them
        (a one-to-many conversion keeps its other targets until they are asked for)."""
        if name in self._made:
            return self._made.pop(name)
        first = self.made_with.get(name, name)
        source = self.sources[first]
        if source.converter is None:
            return read(source.keys[0][0])
        converter = copy.deepcopy(source.converter)
        for key, pattern in source.keys:
            converter.add_tensor(first, key, pattern, lambda key=key: read(key))
        made = converter.convert(first, model=self.model, config=self.model.config)
        for target, value in made.items():
            self._made[target] = value[0] if isinstance(value, list) else value
        if name not in self._made:
            raise ValueError(f"CausalLM.from_pretrained: transformers' conversion of {self.stored_keys(name)} made "
                             f"{sorted(made)}, not {name}.")
        return self._made.pop(name)
