"""A model built on the meta device (``trainer.init_module(empty_init=True)``, ``torch.device("meta")`` in
``configure_model``, ``CausalLM.from_pretrained``) becomes real on each rank for its own stages only, after the cut.
Every module is initialized under its own seed, drawn from one base seed and the module's qualified name, so the
weights do not depend on the layout (pipeline ranks, loops, stage boundaries) nor on which rank builds them;
`seeded_init` gives the same weights to a model in one process."""
from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

from ..contract.hooks import default_init, own_tensors

InitHook = Callable[[str, nn.Module], None]  # (qualified name, module): initialize the module's own tensors


def has_meta_tensors(root: nn.Module) -> bool:
    return any(t.is_meta for m in root.modules() for _, t in own_tensors(m))


def module_seed(base_seed: int, name: str) -> int:
    """The seed that initializes module `name`: the same in every process and every layout."""
    return (base_seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


def _check_metrics(root: nn.Module) -> None:
    """torchmetrics states are plain attributes, not buffers: made on the meta device they hold no values."""
    for name, module in root.named_modules():
        states = getattr(module, "_defaults", None)
        if isinstance(states, dict) and any(isinstance(v, torch.Tensor) and v.is_meta for v in states.values()):
            raise ValueError(
                f"metric {name} ({type(module).__name__}) was created on the meta device (inside "
                "trainer.init_module(empty_init=True) or torch.device('meta')): its states hold no values and cannot "
                "be initialized. Create metrics outside that context, e.g. under `with torch.device('cpu'):` in "
                "__init__ (examples/gpt.py does), or build the layers in configure_model."
            )


def _make_real(root: nn.Module, device: torch.device | None, everything: bool) -> dict[int, torch.Tensor]:
    """Give every meta tensor of `root` (every tensor when `everything`) new memory on `device` (None: where it is,
    CPU for a meta tensor), NaN where it is floating point (what no initializer writes is found afterwards); a tensor
    held by several modules stays one tensor. Returns {id of a module holding a new tensor: one of its new tensors}."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for module in root.modules():
        for key, t in own_tensors(module):
            if everything or t.is_meta:
                holders.setdefault(id(t), []).append((module, key))
                tensors[id(t)] = t
    fresh: dict[int, torch.Tensor] = {}
    for tid, places in holders.items():
        old = tensors[tid]
        new = torch.empty_like(old, device=device or (torch.device("cpu") if old.is_meta else old.device))
        if new.is_floating_point():
            new.fill_(float("nan"))
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        for module, key in places:
            setattr(module, key, new)
            fresh.setdefault(id(module), new)
    return fresh


def _seed(seed: int, devices: list[torch.device]) -> None:
    """Seed the CPU generator and those of `devices` (CUDA) only: other devices' random state stays the user's."""
    torch.default_generator.manual_seed(seed)
    for d in devices:
        with torch.cuda.device(d):
            torch.cuda.manual_seed(seed)


def _check_written(root: nn.Module, fresh: dict[int, torch.Tensor]) -> None:
    for name, module in root.named_modules():
        if id(module) in fresh:
            for key, t in own_tensors(module):
                if t.is_floating_point() and t.numel() and torch.isnan(t.reshape(-1)[[0, -1]]).all():  # first, last
                    raise TypeError(
                        f"{name}.{key} ({type(module).__name__}) was not initialized by {type(module).__name__}'s "
                        "reset_parameters() (or pipeline_init_weights) after the model was built on the meta device: "
                        f"make it write every tensor {type(module).__name__} holds, buffers included."
                    )


def materialize(root: nn.Module, device: torch.device | None, base_seed: int, init: InitHook = default_init,
                everything: bool = False) -> int:
    """Give `root`'s meta tensors memory on `device` and initialize them; returns how many modules it initialized.

    ``init(name, module)`` runs, under ``torch.no_grad()`` and the seed ``module_seed(base_seed, name)`` (the random
    state is restored afterwards), for each module holding such a tensor and for each module above one that holds
    none itself (Hugging Face initializes some weights from the parent module). Children run before their parents,
    later modules before earlier ones: a tensor held by two modules keeps the initialization of the first holder in
    ``named_modules()`` order. A floating-point tensor that no initializer wrote is an error naming it.
    `everything`: re-initialize every tensor, meta or not (`seeded_init`)."""
    _check_metrics(root)
    fresh = _make_real(root, device, everything)
    if not fresh:
        return 0
    named = list(root.named_modules(remove_duplicate=False))
    above = {id(m) for name, m in named if any(id(sub) in fresh for sub in m.modules())}
    cuda = sorted({t.device for t in fresh.values() if t.device.type == "cuda"}, key=str)
    count = 0
    for name, module in reversed(named):
        if id(module) in fresh or (id(module) in above and not any(True for _ in own_tensors(module))):
            with torch.random.fork_rng(devices=cuda), torch.no_grad():
                _seed(module_seed(base_seed, name), cuda)
                init(name, module)
            count += id(module) in fresh
    _check_written(root, fresh)
    return count


def init_hook(module: nn.Module) -> InitHook:
    """The LightningModule's ``pipeline_init_weights`` (see PipelineHooks), else `default_init`."""
    return getattr(module, "pipeline_init_weights", default_init)


def seeded_init(module: nn.Module, seed: int | None = None, device: torch.device | str | None = None,
                only_meta: bool = False) -> nn.Module:
    """Initialize every tensor of `module` in this process as bfpp initializes a model built on the meta device
    (new memory on `device`; default: where each tensor is, CPU for meta tensors): each module under its own seed from
    `seed` (default ``torch.initial_seed()``, which ``seed_everything(s)`` sets to ``s``) and its name. A one-process
    reference for a meta-built model under bfpp, whatever the layout, on the same kind of device (CPU and CUDA
    generators draw differently: ``device="cuda"`` for a GPU run). `only_meta`: leave tensors that are not on the meta
    device as they are. Returns `module`."""
    base = torch.initial_seed() if seed is None else seed
    materialize(module, torch.device(device) if device is not None else None, base, init_hook(module),
                everything=not only_meta)
    return module
