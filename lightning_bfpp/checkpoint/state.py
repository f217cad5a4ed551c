"""What a checkpoint holds of each rank besides the weights: its optimizer state flattened to per-parameter keys,
so every rank saves and loads exactly its parameters' entries whatever the layout, and its random-number state."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

# Optimizer state flattened to per-parameter keys ("state.blocks.3.fc.weight.exp_avg", "param_groups.
# blocks.3.fc.weight.lr"): every rank saves and loads exactly its parameters' entries, whatever the layout.
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
MODEL_OPTIONS = StateDictOptions()


def this_rank() -> int:
    """This process's global rank (0 without a process group, e.g. an export)."""
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> dict[str, torch.Tensor]:
    state = {f"rank{this_rank()}.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"rank{this_rank()}.cuda"] = torch.cuda.get_rng_state()
    return state


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(module, optimizer, options=OPTIM_OPTIONS)
