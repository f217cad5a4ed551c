"""The one-process references of the example GPT (tests/run_tp.py's model) and of the Hugging Face models (tests/
run_hf_exact.py's): each model's loss, optimizer and Lightning's data order over ``one_process.train``, in float64.
The test StackNet's is ``exact_model.reference``."""

from __future__ import annotations

import run_tp
import torch
import torch.nn.functional as F
from gpt import GPT
from one_process import BatchLoss, as_float64, train
from run_hf_exact import LR, experts_kwargs, hf_model, lightning_batches, load_balancing_loss64, lora_model

from lightning_bfpp import mean_loss
from lightning_bfpp.contract.router_loss import load_balancing_loss

STEPS, BATCH = 3, 8  # the workers' default steps (max_steps) and the tests' global batch


def per_batch_aux(auxes: list[tuple[float, int]], parts: int) -> list[float]:
    """Each batch's router loss (train_aux_loss) from its `parts` parts' (aux_loss, counted targets), in order: their
    mean weighted by the counted targets."""
    batches = [auxes[i:i + parts] for i in range(0, len(auxes), parts)]
    return [sum(a * n for a, n in batch) / sum(n for _, n in batch) for batch in batches]


# ---- the example GPT ----
def gpt_reference(steps: int, orders: list[int], opt: str = "sgd", clip: float | None = None, tied: bool = False,
                  batch: int = BATCH, ignored: bool = False, accumulate: int = 1, moe: bool = False,
                  micro_batches: int = 1) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """The example GPT in one process in float64 (``one_process.train``), the same data: step t uses Lightning's
    batches t*accumulate.. under data_parallel = orders[t], the mean over their counted targets (each batch's own mean
    recorded as its loss), each batch in `micro_batches` parts differentiated one by one; a mixture's router loss the
    part's (1: the whole batch's). Returns (parameters, a tied weight under each of its names; train_loss of each batch;
    a mixture's train_aux_loss of each batch, else [])."""
    torch.manual_seed(0)
    model = as_float64(GPT(run_tp.model_config(tied, moe), run_tp.optim_config(opt)))
    auxes: list[tuple[float, int]] = []  # (aux_loss, counted targets) of every part

    def loss(model: GPT, batch) -> BatchLoss:
        x, y = batch
        output = model(x)
        total, counted = model.pipeline_loss(output, y)  # + a mixture's router loss x counted, the part's
        if moe:
            auxes.append((load_balancing_loss(model.head.last_stats).item(), int(counted)))
        return total, counted, mean_loss(model._lm_loss(output, y)).item()  # train_loss: the cross-entropy's mean

    data = (run_tp.lightning_batches(batch, orders[t], ignored)[t * accumulate:(t + 1) * accumulate]
            for t in range(steps))
    losses = train(model, gpt_optimizer(model, opt), data, loss, clip=clip, micro_batches=micro_batches)
    # a tied weight under each of its names (stages on different pipeline ranks hold a copy each)
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return params, losses, per_batch_aux(auxes, micro_batches)


def gpt_optimizer(model: GPT, opt: str = "sgd") -> torch.optim.Optimizer:
    """The example GPT's own optimizer (``GPT.configure_optimizers``: decay on matrices only), without its schedule
    (a constant learning rate here)."""
    o = model.optim
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if opt == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)


# ---- the Hugging Face models ----
def hf_loss(auxes: list[tuple[float, int]] | None = None):
    """The HF model's own training loss of a batch as ``one_process.train`` takes it: (the cross-entropy summed over
    the counted targets (not -100), plus a mixture's router loss (output_router_logits=True: its load_balancing_loss
    over the batch x router_aux_loss_coef) x the counted targets; the counted targets; the cross-entropy's mean).
    `auxes` collects each batch's (aux_loss, counted targets)."""
    def loss(model, batch) -> BatchLoss:
        x, y = batch
        routed = getattr(model.config, "output_router_logits", False)
        out = model(x, output_router_logits=True) if routed else model(x)
        total = F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        items = int((y != -100).sum())
        shown = total.item() / items
        if routed:
            aux = load_balancing_loss64(out.router_logits, model.config.num_experts_per_tok)
            total = total + model.router_aux_loss_coef * aux * items
            if auxes is not None:
                auxes.append((aux.item(), items))
        return total, items, shown

    return loss


def hf_reference(family: str, data_parallel: int, tie: bool | None = None, attn: str = "sdpa", pretrained=None,
                 kv_heads: int = 1, ignored: bool = False, accumulate: int = 1, micro_batches: int = 1,
                 lora: bool = False):
    """The unmodified HF model (`pretrained`: loaded by its class's from_pretrained; `lora`: with run_hf_exact's LoRA
    adapters, PEFT's own model) in float64, its own forward, SGD over its trained parameters on Lightning's data order
    (``one_process.train``, each batch in `micro_batches` parts as the run splits it); each step trains the mean
    cross-entropy over the counted targets (not -100) of all its `accumulate` batches, as one process on the whole
    batch (each batch's own mean recorded as its loss), and a mixture's router loss (output_router_logits=True) of
    each part (`micro_batches` 1: the whole batch's, router_loss="batch"; else each micro-batch's own, "micro_batch")
    weighted by its share of the items. Returns (model, losses, the router loss of each batch for a mixture of
    experts: its parts' weighted by their counted targets)."""
    if lora:
        model = lora_model(family, kv_heads=kv_heads)
    else:
        model = hf_model(family, tie, attn, kv_heads=kv_heads)
    if pretrained is not None:
        model = type(model).from_pretrained(pretrained, dtype=torch.float32, attn_implementation=attn,
                                            **experts_kwargs(family))
    as_float64(model)
    auxes: list[tuple[float, int]] = []  # (aux_loss, counted targets) of every part
    data = lightning_batches(BATCH, data_parallel, ignored)
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    losses = train(model, torch.optim.SGD(trained, lr=LR), ([next(data) for _ in range(accumulate)]
                                                             for _ in range(STEPS)),
                   hf_loss(auxes), micro_batches=micro_batches)
    return model, losses, per_batch_aux(auxes, micro_batches)


def hf_micro_batches(cfg: dict, data_parallel: int) -> int:
    """The parts of a global batch the run differentiates one by one: each replica's batch in `m` micro-batches (a
    router loss over the whole batch, router_loss="batch": one part)."""
    default = "micro_batch" if cfg.get("schedule") in ("1f1b", "depth_first") else "batch"  # (the schedule's)
    whole_batch = cfg["family"] in ("mixtral", "qwen3_moe") and cfg.get("router_loss", default) == "batch"
    return 1 if whole_batch else data_parallel * cfg.get("m", 2)
