"""Lightning's precision plugin as a bfpp run uses it — the run's own plugin, as an instance of a
subclass of its class that clips by the whole model's norm and skips autocast where FSDP2 casts already."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch import nn

ClipNorm = Callable[[Iterable[nn.Parameter], float], Any]


class PipelinePrecision(Precision):
    """What bfpp changes in a precision plugin (mixed into the plugin's own class by `pipeline_precision`).

    - ``clip_grad_by_norm``: each rank holds only its local stages (and shards): `clip_norm` clips by the norm
      over all pipeline and data-parallel ranks (``runtime.reduce.clip_grad_norm_global``).
    - ``forward_context``: none when the stages' FSDP2 MixedPrecisionPolicy already computes in bf16
      (`fsdp_mixed`, "bf16-mixed" with sharded stages); the plugin's own (autocast) otherwise.
    - ``optimizer_step``: `finish_gradients(optimizer)` runs right after the closure (the last backward before the
      step), before ``on_before_optimizer_step`` and clipping see the gradients (the loss rule, ``adapter.training``);
      `after_step()` right after the optimizer's step (cross-step overlap: the next step's first gathers start).
    """

    clip_norm: ClipNorm | None = None
    fsdp_mixed: bool = False
    finish_gradients: Callable[[Any], None] | None = None
    after_step: Callable[[], None] | None = None

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        def closure_then_finish() -> Any:
            result = closure()
            if self.finish_gradients is not None:
                self.finish_gradients(optimizer)
            return result

        result = super().optimizer_step(optimizer, model, closure_then_finish, **kwargs)
        if self.after_step is not None:
            self.after_step()
        return result

    def forward_context(self) -> AbstractContextManager:
        return nullcontext() if self.fsdp_mixed else super().forward_context()

    def clip_grad_by_norm(self, optimizer, clip_val: int | float) -> None:
        assert self.clip_norm is not None, "set by pipeline_precision()"
        self.clip_norm(self.main_params(optimizer), float(clip_val))


_SUBCLASSES: dict[type, type] = {Precision: PipelinePrecision}


def pipeline_precision(plugin: Precision, clip_norm: ClipNorm, fsdp_mixed: bool,
                       finish_gradients: Callable[[Any], None] | None = None,
                       after_step: Callable[[], None] | None = None) -> PipelinePrecision:
    """`plugin` (its state, e.g. the precision string and device) as a `PipelinePrecision`: a new instance of
    ``Pipeline<PluginClass>`` (one subclass per plugin class); a plugin that already is one is updated."""
    if not isinstance(plugin, PipelinePrecision):
        cls = type(plugin)
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(f"Pipeline{cls.__name__}", (PipelinePrecision, cls), {"__module__": __name__})
        sub = _SUBCLASSES[cls]
        copy = sub.__new__(sub)
        copy.__dict__.update(vars(plugin))
        plugin = copy
    plugin.clip_norm, plugin.fsdp_mixed, plugin.finish_gradients = clip_norm, fsdp_mixed, finish_gradients
    plugin.after_step = after_step
    return plugin
