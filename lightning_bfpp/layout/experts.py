"""Expert parallel: the experts of every mixture-of-experts layer split over `expert_parallel` ranks of the
data-parallel group (``dims``: ep inside dp), as torchtitan and Megatron-Core split them. Each rank keeps
1/ep of every experts module's weights (a DTensor sharded on the experts' mesh, so checkpoints keep the model's own
names and shapes and reshard between layouts); a call sends each token's picks to the ranks owning the picked experts
and brings their outputs back (``expert_dispatch``: all-to-all, uneven splits, nothing dropped); the experts' copies
are FSDP-sharded over the remaining dp / ep ranks.

An experts module is what transformers' fused experts are (MixtralExperts, Qwen3MoeExperts, DeepseekV3Experts, ...):
a module with an integer ``num_experts`` whose own parameters all have the experts as their first dimension (at least
one a 3-D stack of matrices), called as ``experts(hidden (tokens, D), top_k_index (tokens, k), top_k_weights (tokens,
k)) -> (tokens, D)``, the weighted sum of each token's picked experts. Its own forward computes this rank's experts
(the model's own expert math, whatever it is)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..dims import EDP, EP
from .expert_dispatch import ExpertParallelForward

INTERFACE = ("a module with an integer `num_experts` whose own parameters all have the experts as their first "
             "dimension (one at least a 3-D stack of matrices), called as experts(hidden, top_k_index, top_k_weights): "
             "transformers' fused experts (MixtralExperts, Qwen3MoeExperts, DeepseekV3Experts, ...) are")


def is_experts(module: nn.Module) -> bool:
    """Whether `module` holds a mixture's experts (see the module docstring); a router (2-D weight) is not."""
    count = getattr(module, "num_experts", None)
    own = list(module.parameters(recurse=False))
    if not (isinstance(count, int) and not isinstance(count, bool) and count > 0 and own):
        return False
    return all(p.dim() >= 2 and p.shape[0] == count for p in own) and any(p.dim() == 3 for p in own)


def experts_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every experts module under `root`."""
    for name, module in root.named_modules():
        if is_experts(module):
            yield name, module


def check_experts(root: nn.Module, expert_parallel: int, setting: str = "expert_parallel") -> list[str]:
    """The experts modules' names; raises (naming `setting`) when `root` has none or one's experts do not split
    into `expert_parallel` equal parts."""
    found = list(experts_modules(root))
    model = type(root).__name__
    if not found:
        raise ValueError(f"{setting}={expert_parallel} splits the experts of each mixture-of-experts layer over "
                         f"data-parallel ranks, and {model} has no experts module ({INTERFACE}); set {setting}=1.")
    for name, module in found:
        if module.num_experts % expert_parallel:
            fits = [d for d in range(1, module.num_experts + 1) if module.num_experts % d == 0]
            raise ValueError(f"{setting}={expert_parallel} must divide the {module.num_experts} experts of "
                             f"{model}.{name} (each rank holds num_experts / {setting} of them); use {setting} in "
                             f"{fits}.")
    return [name for name, _ in found]


def distribute_experts(stages: Iterable[nn.Module], expert_mesh: DeviceMesh) -> list[nn.Module]:
    """Split every experts module of the local `stages` over ``expert_mesh[EP]``: its weights become DTensors sharded
    on their first (expert) dimension, and its calls dispatch tokens to the ranks owning their picked experts
    (``ExpertParallelForward``). Call after the stages are built, materialized, cast and on their device, and before
    FSDP. Returns the experts modules."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep_mesh = expert_mesh[EP]
    done = []
    for stage in stages:
        for _, module in experts_modules(stage):
            forward = ExpertParallelForward(module, ep_mesh.get_group(), ep_mesh.get_local_rank())
            for name, p in list(module.named_parameters(recurse=False)):
                split = distribute_tensor(p.detach(), ep_mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(split, requires_grad=p.requires_grad))
            module.forward = forward
            done.append(module)
    return done


def shard_experts(experts: Iterable[nn.Module], expert_mesh: DeviceMesh, gradient_replicas: int,
                  mp_policy=None) -> None:
    """FSDP2 over the experts' copies (``expert_mesh[EDP]``: x the context-parallel ranks, at this rank's
    tensor-parallel coordinate: the tp ranks compute the experts on the same tokens, so their gradients are the same
    and are not summed over tp), each experts module its
    own unit, gathered once per stage pass like its stage (the runtime's UNSHARD and RESHARD actions reach every FSDP
    unit of a stage). Their gradients are divided by `gradient_replicas` (data parallel x context parallel), as every
    other weight's (FSDP would divide by the copies only; each rank's expert gradient already sums the tokens of its
    ep group): reduced by a plain sum (gloo has no pre-multiplied sum), then divided once, by this module's hook on
    the reduced gradient.
    NOTE torch 2.13: FSDP's own divide factor divides twice over a group of one rank (a single copy) whenever it
    reduces by a sum, as it always does for float64 gradients: so FSDP divides by nothing here."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def divide(reduced: torch.Tensor) -> None:
        reduced.div_(gradient_replicas)

    for module in experts:
        fully_shard(module, mesh=expert_mesh[EDP], reshard_after_forward=False,
                    mp_policy=mp_policy or MixedPrecisionPolicy())
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
        module.set_all_reduce_hook(divide)


def expert_bytes(root: nn.Module) -> int:
    """Bytes of the experts' weights this rank holds (its local shards)."""
    total = 0
    for _, module in experts_modules(root):
        for p in module.parameters(recurse=False):
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
    return total


def local_experts(module: nn.Module) -> torch.Tensor | None:
    """The global ids of the experts this rank holds of an expert-parallel experts module (None: not split)."""
    forward = module.__dict__.get("forward")
    if not isinstance(forward, ExpertParallelForward):
        return None
    return torch.arange(forward.first, forward.first + forward.local)
