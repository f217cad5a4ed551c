"""How a micro-batch's inputs reach every stage: as keyword arguments (``INPUT_KEY*``) that torch's runtime splits
into micro-batches with the rest, from which each stage computes its side inputs."""
from __future__ import annotations

from typing import Any

import torch

INPUT_KEY = "bfpp_input"  # keyword arguments carrying the micro-batch's inputs to every stage


def input_kwargs(inputs: Any) -> dict[str, torch.Tensor]:
    """The pipeline inputs as keyword arguments for every stage (torch splits them into micro-batches)."""
    if isinstance(inputs, tuple):
        return {f"{INPUT_KEY}_{i}": t for i, t in enumerate(inputs)}
    return {INPUT_KEY: inputs}


def stage_inputs(kwargs: dict[str, Any]) -> Any:
    """One micro-batch's inputs from the keyword arguments of `input_kwargs`."""
    if INPUT_KEY in kwargs:
        return kwargs[INPUT_KEY]
    return tuple(kwargs[f"{INPUT_KEY}_{i}"] for i in range(len(kwargs)))
