"""lightning-bfpp: Breadth-First Pipeline Parallelism (arXiv 2211.05953) as a Lightning strategy.

``import lightning_bfpp`` registers ``Trainer(strategy="bfpp")``. The package itself imports neither Lightning nor
torch: ``lightning_bfpp.schedule`` and ``lightning_bfpp.sim`` load in milliseconds. The names below are loaded on
first use (PEP 562); what a model's own layers call is ``lightning_bfpp.modeling``. The strategy is registered in
Lightning's ``StrategyRegistry`` as soon as ``lightning.pytorch.strategies`` exists: right away if Lightning is
imported already, else when Lightning's strategies module finishes importing (a one-shot import hook,
``_RegisterWhenImported``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import Any

_LAZY = {
    "BFPPStrategy": "lightning_bfpp.strategy",
    "PipelineHooks": "lightning_bfpp.contract.hooks",
    "PipelineMetrics": "lightning_bfpp.adapter.metrics",
    "PipelineTrace": "lightning_bfpp.adapter.trace",
    "ScheduleError": "lightning_bfpp.schedule",
    "ScheduleSpec": "lightning_bfpp.schedule",
    "build_schedule": "lightning_bfpp.schedule",
    "seeded_init": "lightning_bfpp.layout.materialize",
    "mean_loss": "lightning_bfpp.contract.hooks",
    # the layout a BFPPStrategy argument may be, and the errors a user catches
    "AutoLayout": "lightning_bfpp.layout.auto",
    "ParallelDims": "lightning_bfpp.dims",
    "LayoutError": "lightning_bfpp.dims",
    "StorageError": "lightning_bfpp.checkpoint",
    "StorageNames": "lightning_bfpp.checkpoint",
    # Hugging Face models (needs the [hf] extra when a model is wrapped)
    "CausalLM": "lightning_bfpp.hf",
}
__all__ = list(_LAZY)

_STRATEGIES = "lightning.pytorch.strategies"  # the module that defines Lightning's StrategyRegistry
DESCRIPTION = "Breadth-first pipeline parallelism with FSDP over data parallel"


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def bfpp_strategy(**kwargs: Any):
    """``StrategyRegistry``'s entry for "bfpp" (a callable, as ``StrategyRegistry.register`` takes): imports the
    strategy when a Trainer asks for it, so registering costs no import."""
    from .strategy import BFPPStrategy

    return BFPPStrategy(**kwargs)


def _register(registry) -> None:
    if "bfpp" not in registry:
        registry.register("bfpp", bfpp_strategy, description=DESCRIPTION)


class _RegisterWhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when ``lightning.pytorch.strategies`` is imported, wraps its loader so that "bfpp" is
    registered right after the module ran (then leaves ``sys.meta_path``)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _STRATEGIES:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:  # whichever finder would have found it (usually the PathFinder)
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _register(module.StrategyRegistry)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for tracebacks and inspect
        return getattr(self.inner, name)


if _STRATEGIES in sys.modules:
    _register(sys.modules[_STRATEGIES].StrategyRegistry)
elif not any(isinstance(f, _RegisterWhenImported) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenImported())
