"""Pretrained Hugging Face weights read per stage. `CausalLM.from_pretrained` builds the model on the meta device
(`build_on_meta`); after the cut, each rank reads only its own tensors from the model's safetensors files
(`SafetensorsWeights`: memory-mapped, sharded indexes included), converting stored keys as transformers does at load
(`stored_keys`). Nothing is downloaded unless the name is not a local directory and the network allows it."""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .stored_keys import StoredKeys

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
MODEL_KWARGS = ("attn_implementation", "dtype", "torch_dtype", "trust_remote_code")  # for the model, not its config
HUB_KWARGS = ("revision", "token", "cache_dir", "subfolder")  # where the files come from


def local_directory(name_or_path: str | os.PathLike, hub_kwargs: dict[str, Any], remote_code: bool = False) -> Path:
    """`name_or_path` (its ``subfolder``) when it is a directory; else a hub name, fetched (configs, ``model*``
    safetensors, and code with `remote_code`) where the network allows with `hub_kwargs` (``revision``, ``token``,
    ``cache_dir``), or an OSError that says how to get a local directory."""
    subfolder = hub_kwargs.pop("subfolder", None) or ""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path / subfolder
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*model*.safetensors", *(["*.py"] if remote_code else [])]
        return Path(snapshot_download(str(name_or_path), allow_patterns=patterns, **hub_kwargs)) / subfolder
    except Exception as err:
        raise OSError(
            f"CausalLM.from_pretrained({str(name_or_path)!r}): no such local directory, and the Hugging Face Hub did "
            f"not provide it ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Pass a "
            "directory written by save_pretrained, or download one where the network allows (`hf download NAME "
            "--local-dir DIR`)."
        ) from err


def build_on_meta(directory: Path, hf_kwargs: dict[str, Any]) -> nn.Module:
    """The ``*ForCausalLM`` of `directory`'s config.json, its parameters on the meta device (no memory, no init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_kwargs = {k: hf_kwargs.pop(k) for k in MODEL_KWARGS if k in hf_kwargs}
    dtype = model_kwargs.pop("dtype", model_kwargs.pop("torch_dtype", None))
    config, unused = AutoConfig.from_pretrained(directory, return_unused_kwargs=True,
                                                trust_remote_code=model_kwargs.get("trust_remote_code"), **hf_kwargs)
    if dtype == "auto":  # Hugging Face's word for the stored dtype
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.get_default_dtype()
    # default: the Trainer's precision decides, not the file (Lightning's init_module sets it for "-true" precisions)
    model_kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.get_default_dtype()
    if unused:
        raise TypeError(
            f"CausalLM.from_pretrained: {sorted(unused)} are neither {type(config).__name__} fields nor "
            f"{', '.join(MODEL_KWARGS)}; bfpp places and loads the weights itself (no device_map, quantization or "
            "low_cpu_mem_usage)."
        )
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, **model_kwargs)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and keep their buffers (rotary frequencies,
    causal masks: small, and computed in ``__init__`` where no initializer would recompute them). Each parameter is
    moved as it is registered, before its module's own initialization runs (on the meta device then: no work)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def stored_names(model: nn.Module) -> dict[str, list[str]]:
    """Every parameter and buffer name -> the other names a checkpoint may store it under: a tied tensor's other
    names (``lm_head.weight`` and ``model.embed_tokens.weight``: one is stored), and the name without the base
    model's prefix (a checkpoint saved from the base model, e.g. ``h.0.attn...`` for ``transformer.h.0.attn...``)."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    aliases: dict[str, list[str]] = {}
    for group in names.values():
        others = [*group, *(n[len(prefix):] for n in group if prefix != "." and n.startswith(prefix))]
        for n in group:
            aliases[n] = [o for o in others if o != n]
    return aliases


def own_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s own entries of its state dict (parameters and persistent buffers, not its children's)."""
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if "." not in k}


class SafetensorsWeights:
    """The tensors of a directory saved by ``save_pretrained`` (``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``), read by name on demand: under the model's names (or a tied or base-model name,
    `aliases`), else made from the stored keys transformers converts into them at load (`model`'s conversions)."""

    def __init__(self, directory: Path, aliases: dict[str, list[str]], model: nn.Module | None = None,
                 plain: Callable[[str], str] | None = None):
        from safetensors import safe_open

        self.plain = plain or (lambda name: name)  # a name as the directory's model names it (LoRA: ``hf.lora``)
        aliases = {self.plain(k): [self.plain(o) for o in v] for k, v in aliases.items()}
        self.directory, self.aliases, self._open = directory, aliases, safe_open
        if (directory / INDEX).is_file():
            self.file_of = dict(json.loads((directory / INDEX).read_text())["weight_map"])
        elif (directory / SINGLE).is_file():
            with safe_open(directory / SINGLE, framework="pt") as f:
                self.file_of = dict.fromkeys(f.keys(), SINGLE)
        else:
            found = sorted(p.name for p in directory.iterdir())[:8]
            raise FileNotFoundError(
                f"CausalLM.from_pretrained: {directory} has no {SINGLE} or {INDEX} (it has {found}); bfpp reads "
                "safetensors only: save the model with save_pretrained(dir) (safe_serialization is the default)."
            )
        self.converted = StoredKeys(model, self.file_of, self.plain) if model is not None else None
        self.missing: list[str] = []

    def key(self, name: str) -> str | None:
        """The stored key of parameter or buffer `name` (itself, or a name tied to it), or None."""
        name = self.plain(name)
        return next((k for k in (name, *self.aliases.get(name, ())) if k in self.file_of), None)

    def stores(self, name: str) -> bool:
        return self.key(name) is not None or self.converted is not None and self.converted.makes(self.plain(name))

    def stores_all(self, prefix: str, module: nn.Module) -> bool:
        return all(self.stores(prefix + n) for n in own_state(module))

    @torch.no_grad()
    def load(self, prefix: str, module: nn.Module) -> None:
        """Copy the stored values into `module`'s own parameters and persistent buffers (cast to their dtype); a
        parameter not stored is an error, a buffer not stored is recorded in `missing`."""
        params = {n for n, _ in module.named_parameters(recurse=False)}
        with ExitStack() as files:  # memory-mapped; closed after this module
            opened: dict[str, Any] = {}

            def read(key: str) -> torch.Tensor:
                file = self.file_of[key]
                if file not in opened:
                    opened[file] = files.enter_context(self._open(self.directory / file, framework="pt"))
                return opened[file].get_tensor(key)

            for n, target in own_state(module).items():
                name, key = prefix + n, self.key(prefix + n)
                if key is not None:
                    value, where = read(key), f"{key} in {self.directory / self.file_of[key]}"
                elif self.stores(name):
                    made = self.plain(name)
                    value, where = self.converted.make(made, read), f"{made} made from {self._sources(made)}"
                elif n in params:
                    some = ", ".join(list(self.file_of)[:3])
                    raise ValueError(
                        f"CausalLM.from_pretrained: {self.directory} stores no {name} (nor a name tied to it, nor keys "
                        f"the installed transformers converts into it); it stores e.g. {some}. Load it in memory "
                        "instead: CausalLM(XForCausalLM.from_pretrained(path)), or save it again with save_pretrained "
                        "from such a model."
                    )
                else:
                    self.missing.append(name)
                    continue
                if value.shape != target.shape:
                    raise ValueError(f"CausalLM.from_pretrained: {where} has shape {tuple(value.shape)}; the model's "
                                     f"config makes it {tuple(target.shape)}.")
                target.copy_(value)

    def _sources(self, name: str) -> str:
        keys = self.converted.stored_keys(name)
        return f"{keys[0]}" + (f" and {len(keys) - 1} more stored keys" if len(keys) > 1 else "")
