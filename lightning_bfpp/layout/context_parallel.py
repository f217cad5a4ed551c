"""Whether a model's layers can run on a shard of every sequence (``BFPPStrategy(context_parallel>1)``): the model
says so per layer (``pipeline_context_parallel``), and a layer it does not vouch for is refused, named, before any
process starts. A layer that mixes tokens some other way than through ``contract.context_parallel.attention`` (an
``F.scaled_dot_product_attention`` of its own, a convolution or a recurrence over the sequence) would silently attend
within its shard only."""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..contract.hooks import defined_hook
from ..dims import LayoutError
from .names import layer_names

HOOK = "pipeline_context_parallel"


def check_context_parallel(root: nn.Module, layers: Sequence[nn.Module], context_parallel: int) -> None:
    """Ask ``root.pipeline_context_parallel(layer_name, layer, context_parallel)`` of every layer; raise LayoutError
    naming the first layer it does not vouch for (False, no hook), or its own reason (an exception it raises)."""
    model = type(root).__name__
    hook = defined_hook(root, HOOK)
    fix = (f"define {model}.{HOOK}(layer_name, layer, context_parallel) returning True for the layers that run on a "
           "shard of every sequence (attention through lightning_bfpp.contract.context_parallel.attention, positions "
           "from token_positions: docs/context_parallel.md), or set context_parallel=1")
    if not callable(hook):
        raise LayoutError(f"context_parallel={context_parallel} splits every sequence over {context_parallel} ranks, "
                          f"and {model} does not say which of its layers run on a shard of the sequence: {fix}.")
    for layer, name in zip(layers, layer_names(root, layers)):
        kind = type(layer).__name__
        described = name if kind in name else f"{name} ({kind})"
        try:
            ok = hook(name, layer, context_parallel)
        except (TypeError, ValueError) as error:
            raise LayoutError(f"context_parallel={context_parallel}: {model}'s layer {described} cannot run on a "
                              f"shard of the sequence: {error}") from error
        if ok is not True:
            raise LayoutError(
                f"context_parallel={context_parallel} splits every sequence over {context_parallel} ranks, and "
                f"{model}.{HOOK}({name!r}, ...) returned {ok!r}: layer {described} would attend within its shard "
                f"only; {fix}.")
