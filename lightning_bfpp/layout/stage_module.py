"""The module of one pipeline stage: a contiguous run of the model's layers, registered under the model's own
names, run in order with their side inputs (and activation checkpointing when asked)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..contract.layer_io import LayerCall, check_boundary, compute_side_inputs, describe_structure
from .stage_inputs import stage_inputs


class StageModule(nn.Module):
    """A contiguous run of the model's layers; their state is registered under the root's qualified names.

    `named_layers`: (name in root, module) of the state to register (the layers themselves, or the modules that
    wrapper layers wrap); `calls`: the layers to run, in order (default: the registered modules). `side_inputs`:
    the module's ``pipeline_side_inputs``, computed here once per micro-batch from the micro-batch's inputs (which
    the runner passes to every stage as keyword arguments, ``INPUT_KEY*``).
    """

    def __init__(
        self,
        named_layers: Sequence[tuple[str, nn.Module]],
        index: int = 0,
        rank: int = 0,
        calls: Sequence[tuple[str, nn.Module]] | None = None,
        side_inputs: Callable[[Any], dict[str, Any]] | None = None,
        last: bool = True,
    ):
        super().__init__()
        self.index, self.rank, self.last = index, rank, last  # global stage index, pipeline rank: named in errors
        self._calls = [LayerCall(mod, name) for name, mod in (calls if calls is not None else named_layers)]
        self._side_inputs = side_inputs
        self._part_names = [name for name, _ in named_layers]
        for name, layer in named_layers:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            parent.add_module(leaf, layer)

    # Set by the strategy (activation_checkpointing=True): each layer keeps only its inputs for backward
    # and runs its forward again there (torch.utils.checkpoint, non-reentrant). Wrapping happens here, per
    # call, so no module is wrapped and parameter names and state-dict keys stay the model's own.
    activation_checkpointing: bool = False
    # Set by the strategy when FSDP computes the stage in a lower precision than its parameters ("bf16-mixed",
    # sharded): FSDP casts the stage's float inputs to it, and the side inputs computed here (rotary cos/sin,
    # masks: in the default dtype) are cast alike, as a model's own forward makes them in its hidden states' dtype.
    side_input_dtype: torch.dtype | None = None

    # Set when each layer is its own FSDP unit (``shard_unit="layer"``): the runtime lets each unit wait for its own
    # gathered weights (``_private.pipelining.each_unit_waits_for_its_own``).
    per_layer_units: bool = False

    def layer_modules(self) -> list[nn.Module]:
        """The modules that hold the stage's layers' state (a layer, or the modules a wrapper layer wraps), in order."""
        return [self.get_submodule(name) for name in self._part_names]

    def compile_layers(self) -> None:
        """torch.compile each layer in place (``nn.Module.compile``: names and state-dict keys stay the model's)."""
        for call in self._calls:
            call.layer.compile()

    def forward(self, *args, **kwargs):
        side = None
        if self._side_inputs is not None and kwargs:
            side = compute_side_inputs(self._side_inputs, stage_inputs(kwargs))
            if self.side_input_dtype is not None:
                side = apply_to_collection(side, torch.Tensor, _cast_float, self.side_input_dtype)
        out = args if len(args) != 1 else args[0]
        if self.index == 0 and self._side_inputs is not None:  # the inputs the first layer takes (contract.hooks)
            out = self._calls[0].leading_inputs(out)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for i, call in enumerate(self._calls):
            if side is None and not recompute and isinstance(out, torch.Tensor):  # the common case, kept short: a
                try:  # layer's output is the next layer's one argument (the host time of a step is a point here)
                    out = call.layer(out)
                    continue
                except Exception as error:
                    self._note_where(error, call, args, (out,), {})
                    raise
            if isinstance(out, dict) and call.keywords is not None and not set(out) <= call.keywords:
                raise TypeError(
                    f"bfpp: layer {self._calls[i - 1].name if i else '(stage input)'} of stage {self.index} returned "
                    f"dict ({describe_structure(out)}): a pipeline layer must return a tensor or a tuple of tensors "
                    f"(its next layer's arguments), or a dict whose keys the next layer ({call.name}) takes as "
                    f"keywords ({', '.join(sorted(set(out) - call.keywords))} it does not)."
                )
            inputs, kw = call.arguments(out, side)
            try:
                # tensors passed as separate arguments: checkpoint saves them through autograd (so the
                # saved-activation meter counts them) and re-runs layer(*inputs) in backward
                out = checkpoint(call.layer, *inputs, use_reentrant=False, context_fn=call.recompute_contexts, **kw) \
                    if recompute else call.layer(*inputs, **kw)
            except Exception as error:
                self._note_where(error, call, args, inputs, kw)
                raise
        if _passes_between_stages(out):
            return out
        if not self.last:
            check_boundary(out, f"layer {call.name}, the last of stage {self.index} (pipeline rank {self.rank}),")
        else:
            raise TypeError(
                f"bfpp: layer {call.name} of stage {self.index} returned {describe_structure(out)}: the last layer "
                "must return a tensor or a tuple of tensors (what pipeline_loss receives); return a tuple in a fixed "
                "order instead of a dict, or wrap the layer."
            )
        return out

    def _note_where(self, error: Exception, call: LayerCall, args: tuple, inputs: Sequence[Any],
                    kw: dict[str, Any]) -> None:
        """Say where in the pipeline a layer failed, and what came in (e.g. a new sequence length)."""
        keywords = f", keywords {', '.join(kw)}" if kw else ""
        order = ", ".join(c.name for c in self._calls)
        error.add_note(f"bfpp: in layer {call.name} of stage {self.index} (pipeline rank {self.rank}; layers {order}); "
                       f"stage input {describe(args)}, layer input {describe(inputs)}{keywords}")


def _passes_between_stages(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def describe(values: Sequence[Any]) -> str:
    """'float32[4, 16], int64[4]': dtypes and shapes of tensors (other values by type)."""
    return ", ".join(
        f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
        for v in values
    )


def _cast_float(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t
