"""The example model — a byte-level, nanoGPT-style GPT as a LightningModule that opts into
bfpp through PipelineHooks. It trains the same way with or without `strategy="bfpp"`. With `n_experts` > 0 each
block's MLP is a mixture of experts with its router's load-balancing loss (``moe.py``: ``MoE``, ``Experts``;
model=gpt_moe_tiny), whose experts ``BFPPStrategy(expert_parallel=N)`` splits over data-parallel ranks."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from moe import Experts, MoE, check_moe_settings, grouped_matmul, idle_expert_params, log_routing
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from lightning_bfpp.modeling import (
    PipelineHooks,
    active_step_totals,
    attention,
    document_causal_mask,
    document_positions,
    load_balancing_loss,
    mean_loss,
    router_loss,
    split_documents,
    step_aux_loss,
    token_positions,
)
from lightning_bfpp.sim import training_flops_per_token

# what the app, tests, benchmarks and docs import from here (the mixture of experts' parts are moe.py's)
__all__ = ["GPT", "GPTConfig", "OptimConfig", "Embedding", "Block", "Head", "Experts", "MoE", "grouped_matmul",
           "lr_factor", "matmul_params", "flops_per_token", "IGNORED"]

IGNORED = -100  # a target that no loss counts (prompt tokens, padding), as PyTorch's and Hugging Face's losses


@dataclass
class GPTConfig:
    n_layer: int = 4  # transformer blocks (the pipeline cuts between layers: embedding, blocks, head)
    n_head: int = 4  # attention heads; n_embd must be divisible by it
    n_embd: int = 128  # width of the residual stream
    block_size: int = 64  # context length in tokens (bytes)
    vocab_size: int = 256  # 256 for byte-level text
    dropout: float = 0.0  # dropout on attention, MLP and embedding outputs
    tie_weights: bool = False  # share the token embedding with the output head (bfpp: a copy per stage, grads summed)
    # recompute each block in backward instead of saving its activations. This is the plain-Lightning
    # switch (strategy=auto); under bfpp examples/train.py passes it to BFPPStrategy(activation_checkpointing=)
    # instead, which checkpoints every layer of every stage, and sets this one to False.
    activation_checkpointing: bool = False
    # mixture of experts (moe.py)
    n_experts: int = 0  # > 0: each block's MLP is a mixture of this many experts (4 x n_embd wide), top_k per token
    top_k: int = 2  # experts per token
    router_aux_loss_coef: float = 0.01  # weight of the router's load-balancing loss in the training loss (0: off)


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 3e-3  # peak learning rate (after warmup)
    weight_decay: float = 0.1  # applied to weight matrices and embeddings only, not to biases or norms
    betas: tuple[float, float] = (0.9, 0.95)  # adamw only
    eps: float = 1e-8  # adamw only: added to sqrt(v); a gradient below it moves its weight by less than lr
    momentum: float = 0.9  # sgd only
    warmup_steps: int = 20  # linear warmup from 0
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps


class Embedding(nn.Module):
    """idx (B, T) int64 -> token + position embeddings (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor, *, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` (B, T): positions restarting at each packed document (GPT.pipeline_side_inputs); else
        0..T-1, or under context parallel this rank's tokens' positions in the whole sequence."""
        pos = token_positions(idx.shape[1], idx.device) if position_ids is None else position_ids
        return self.drop(self.tok(idx) + self.pos(pos))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); (B, T, C) -> (B, T, C). With a mixture of
    experts as its MLP: (x, routing statistics so far) -> (x, statistics with this block's added)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_size, self.dropout, self.checkpointing = (cfg.n_embd // cfg.n_head, cfg.dropout,
                                                            cfg.activation_checkpointing)
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        # separate query/key/value projections: tensor parallel splits each by heads (see GPT.pipeline_tp_plan)
        self.q, self.k, self.v = (nn.Linear(cfg.n_embd, cfg.n_embd) for _ in range(3))
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MoE(cfg, 0.02 / math.sqrt(2 * cfg.n_layer)) if cfg.n_experts else nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )
        self.resid_drop = nn.Dropout(cfg.dropout)

    def _forward(self, x: torch.Tensor, stats: torch.Tensor | None = None,
                 attn_mask: torch.Tensor | None = None) -> Any:
        h = self.ln_1(x)
        B, T, _ = h.shape  # the whole sequence (under sequence parallel x is this rank's shard; h is gathered)
        # (B, nh, T, hs); under tensor parallel nh is this rank's heads (q/k/v hold n_head / tp heads' columns)
        q, k, v = (f(h).view(B, T, -1, self.head_size).transpose(1, 2) for f in (self.q, self.k, self.v))
        # causal; with packed documents, attn_mask (B, 1, T, T) keeps each token within its document. Under context
        # parallel (T: this rank's share of the sequence) over the keys and values of the whole sequence, gathered from
        # the context-parallel ranks (F.scaled_dot_product_attention otherwise)
        y = attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                      dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)  # re-assemble heads: (B, T, nh * hs)
        x = x + self.resid_drop(self.proj(y))
        if not isinstance(self.mlp, MoE):
            return x + self.mlp(self.ln_2(x))
        y, routed = self.mlp(self.ln_2(x))
        return x + self.resid_drop(y), routed if stats is None else stats + routed

    def forward(self, x: torch.Tensor, stats: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> Any:
        """`stats`: the routing statistics of the blocks before (a mixture of experts hands its own on with `x`);
        `attn_mask`: packed documents' mask (a side input, contract.documents)."""
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, x, stats, attn_mask, use_reentrant=False)
        return self._forward(x, stats, attn_mask)


class Head(nn.Module):
    """(B, T, C) -> logits (B, T, V); a mixture's routing statistics, passed along, are kept for the loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.last_stats: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
        self.last_stats = stats
        return self.lm_head(self.ln_f(x))


class GPT(PipelineHooks, L.LightningModule):
    def __init__(self, cfg: GPTConfig | dict, optim: OptimConfig | dict | None = None) -> None:
        super().__init__()
        cfg = GPTConfig(**cfg) if isinstance(cfg, dict) else cfg
        optim = OptimConfig(**optim) if isinstance(optim, dict) else optim
        # plain dicts in checkpoints: GPT.load_from_checkpoint(file) rebuilds the model, no pickled classes needed
        self.save_hyperparameters({"cfg": asdict(cfg), "optim": asdict(optim or OptimConfig())})
        if not (isinstance(cfg.n_head, int) and cfg.n_head >= 1 and cfg.n_embd % cfg.n_head == 0):
            heads = [h for h in range(1, min(cfg.n_embd, 16) + 1) if cfg.n_embd % h == 0] if cfg.n_embd >= 1 else []
            raise ValueError(
                f"model.n_embd={cfg.n_embd} must be divisible by model.n_head={cfg.n_head} (a positive number of "
                f"attention heads of equal width); use model.n_head in {heads}, or make model.n_embd a multiple "
                "of model.n_head."
            )
        check_moe_settings(cfg)
        self.cfg, self.optim = cfg, optim or OptimConfig()
        # a mixture of experts: the router's loss through the step's totals (the whole step's routing, or each
        # micro-batch's own: BFPPStrategy(router_loss=...)); the step's totals are kept to log it (pipeline_step_logs)
        self.pipeline_uses_step_totals = cfg.n_experts > 0
        self._router_totals = None
        self.embedding = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)
        # eval metrics (torchmetrics, synced over data parallel at epoch end): next-byte accuracy, bits per byte
        # (on the CPU even inside trainer.init_module(empty_init=True): metric states are values, not weights)
        with torch.device("cpu"):
            metrics = MetricCollection({"acc": MulticlassAccuracy(cfg.vocab_size, average="micro",
                                                                  ignore_index=IGNORED),
                                        "bpb": MeanMetric()})
        self.val_metrics, self.test_metrics = metrics.clone(prefix="val_"), metrics.clone(prefix="test_")
        if cfg.tie_weights:
            self.head.lm_head.weight = self.embedding.tok.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2 * n_layer)
            if name.endswith(tuple(f"{m}.weight" for m in self.RESIDUAL_PROJECTIONS)):
                nn.init.normal_(p, mean=0.0, std=self._residual_std)

    RESIDUAL_PROJECTIONS = ("proj", "mlp.2")  # the modules whose output is added to the residual stream

    @property
    def _residual_std(self) -> float:
        return 0.02 / math.sqrt(2 * self.cfg.n_layer)

    @staticmethod
    def _init_weights(m: nn.Module, std: float = 0.02) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def pipeline_init_weights(self, name: str, module: nn.Module) -> None:
        """The same rule for a model built on the meta device (``trainer.init_module(empty_init=True)``), applied by
        bfpp to each rank's own modules, each under its own seed (so not the eager model's values)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            self._init_weights(module, self._residual_std if name.endswith(self.RESIDUAL_PROJECTIONS) else 0.02)
        else:
            super().pipeline_init_weights(name, module)

    # ---- PipelineHooks: the contract bfpp cuts along ----
    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embedding, *self.blocks, self.head]

    def pipeline_side_inputs(self, inputs) -> dict:
        """For a window packing documents, inputs (tokens, document ids) (contract.documents): positions restarting
        at each document and a mask keeping attention within it, computed on every stage; nothing for plain tokens."""
        _, documents = split_documents(inputs)
        if documents is None:
            return {}
        return {"position_ids": document_positions(documents), "attn_mask": document_causal_mask(documents)}

    def pipeline_tp_plan(self, layer_name: str, layer: nn.Module, tensor_parallel: int,
                         sequence_parallel: bool = False) -> dict | None:
        """Megatron-style split of each block: q/k/v column-wise (n_head / tp heads per rank), proj row-wise (its
        output all-reduced, replicated); MLP up column-wise, down row-wise; ln_1 and ln_2 hand their output on as one
        replicated tensor (so the gradient of q/k/v's input is all-reduced once, not three times). Untied, the token
        embedding is split by vocabulary rows (lookups summed over the tp group) and the output head by vocabulary
        columns (logits gathered); tied, both stay whole (a tied weight cannot be split). Every layer's output is whole.
        `sequence_parallel`: between layers each rank holds its 1/tp of the sequence; the norms run on it and are
        all-gathered after (ln_1, ln_2) or before (the head); proj and mlp.2 reduce-scatter instead of all-reduce;
        the embedding's output is cut to the rank's shard. A mixture-of-experts block splits its attention only
        (`_moe_block_plan`)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from lightning_bfpp.modeling import (
            replicated_output,
            sequence_gather,
            sequence_parallel_norm,
            sequence_scatter,
        )

        if self.cfg.n_head % tensor_parallel:
            fits = [t for t in range(1, self.cfg.n_head + 1) if self.cfg.n_head % t == 0]
            raise ValueError(f"model.n_head={self.cfg.n_head} must be divisible by tensor_parallel={tensor_parallel} "
                             "(each tensor-parallel rank computes n_head / tp whole heads); use tensor_parallel in "
                             f"{fits}, or model.n_head a multiple of {tensor_parallel}.")
        sp = sequence_parallel
        if isinstance(layer, Embedding):
            plan = {} if self.cfg.tie_weights else {"tok": RowwiseParallel(input_layouts=Replicate())}
            return {**plan, "": sequence_scatter()} if sp else plan or None
        if isinstance(layer, Head):
            plan = {} if self.cfg.tie_weights else {"lm_head": ColwiseParallel(output_layouts=Replicate())}
            return {**plan, "": sequence_gather(use_local_output=True)} if sp else plan or None
        if not isinstance(layer, Block):
            return None
        if self.cfg.n_experts:  # attention split; the mixture whole on every tp rank, on the same tokens
            return self._moe_block_plan(sp)
        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "mlp.0": ColwiseParallel()}
        if not sp:  # the norms' outputs handed on as one replicated tensor: q/k/v's input gradients all-reduced once
            return {**plan, "proj": RowwiseParallel(), "mlp.2": RowwiseParallel(),
                    "ln_1": replicated_output(), "ln_2": replicated_output()}
        scatter = RowwiseParallel(output_layouts=Shard(1))  # its output summed over tp and cut to this rank's shard
        return {**plan, "proj": scatter, "mlp.2": scatter,
                "ln_1": sequence_parallel_norm(gather_output=True), "ln_2": sequence_parallel_norm(gather_output=True)}

    @staticmethod
    def _moe_block_plan(sequence_parallel: bool) -> dict:
        """A mixture-of-experts block: attention split as in a dense block; the router and the experts computed whole
        on every tensor-parallel rank, on the whole sequence (Megatron's expert tensor-parallel size 1: expert
        parallel, not tp, splits the experts), so every tp rank routes the same tokens and gets the same gradients.
        `sequence_parallel`: ln_2 runs on this rank's shard (its weights' gradients summed over tp), the mixture
        gathers the sequence and hands back this rank's shard (``whole_block``); without it ln_2 and the mixture
        are plain (their input is whole and the same on every tp rank)."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from lightning_bfpp.modeling import replicated_output, sequence_parallel_norm, whole_block

        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel()}
        if not sequence_parallel:
            return {**plan, "proj": RowwiseParallel(), "ln_1": replicated_output()}
        return {**plan, "proj": RowwiseParallel(output_layouts=Shard(1)),
                "ln_1": sequence_parallel_norm(gather_output=True), "ln_2": sequence_parallel_norm(local_output=True),
                "mlp": whole_block()}

    def pipeline_context_parallel(self, layer_name: str, layer: nn.Module, context_parallel: int) -> bool:
        """Every layer runs on a shard of each sequence: the embedding takes its tokens' positions from
        token_positions, a block attends through contract.context_parallel.attention, the head is per token."""
        return isinstance(layer, (Embedding, Block, Head))

    def _lm_loss(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        target = target.reshape(-1)
        loss = F.cross_entropy(output.reshape(-1, output.shape[-1]), target, ignore_index=IGNORED, reduction="sum")
        return loss, (target != IGNORED).sum()

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed nats, counted targets): targets of -100 (prompt tokens, padding) are not counted, and bfpp trains
        the mean over the global batch's counted targets, as one process. A mixture of experts adds its router's
        load-balancing loss x router_aux_loss_coef x counted targets (contract.router_loss: over the whole batch, or
        under bfpp's router_loss="micro_batch" over each micro-batch)."""
        loss, items = self._lm_loss(output, target)
        if self.cfg.n_experts:
            self._router_totals = active_step_totals()  # under bfpp: the step's routing, logged after it
            loss = loss + router_loss(self.head.last_stats, items, self.cfg.router_aux_loss_coef)
        return loss, items

    def pipeline_step_logs(self) -> None:
        if self.cfg.n_experts and self._router_totals is not None:  # the step's routing (moe.log_routing)
            log_routing(self, self._router_totals.total("router_stats"), step_aux_loss(self._router_totals))

    # ---- plain Lightning (no bfpp): the same loss under the same names ----
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Logits of tokens, or of (tokens, document ids): ``self(x)`` or ``self(*x)``."""
        return self.pipeline_forward(inputs[0] if len(inputs) == 1 else inputs)

    def _loss(self, batch) -> torch.Tensor:
        """The batch's training loss (with a mixture of experts' router loss), as one process trains it."""
        x, y = self.pipeline_inputs(batch)
        return mean_loss(self.pipeline_loss(self(x), y))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = self.pipeline_inputs(batch)
        output = self(x)
        self.log("train_loss", mean_loss(self._lm_loss(output, y)), prog_bar=True, sync_dist=True)  # as bfpp logs it
        if self.cfg.n_experts:
            log_routing(self, self.head.last_stats, load_balancing_loss(self.head.last_stats), sync_dist=True)
        return mean_loss(self.pipeline_loss(output, y))

    def _eval(self, batch, metrics: MetricCollection) -> torch.Tensor:
        x, y = self.pipeline_inputs(batch)
        logits = self(x)  # under bfpp: the pipeline's output
        loss_sum, counted = self._lm_loss(logits, y)
        loss = loss_sum / counted
        metrics["acc"].update(logits.argmax(-1), y)
        metrics["bpb"].update(loss / math.log(2), weight=counted)
        self.log_dict(metrics)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_loss", self._eval(batch, self.val_metrics), prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx: int) -> None:
        self.log("test_loss", self._eval(batch, self.test_metrics), sync_dist=True)

    def configure_optimizers(self):
        o = self.optim
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if o.name == "adamw":
            opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        elif o.name == "sgd":
            opt = torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
        else:
            raise ValueError(f"optim.name={o.name!r} is not one of: adamw, sgd")
        total = (max(self.trainer.max_steps, 1) if self.trainer.max_steps > 0
                 else int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.LambdaLR(opt,
                                                  lambda step: lr_factor(step, o.warmup_steps, total, o.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total` steps (and flat after)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def matmul_params(model: nn.Module) -> int:
    """Weights that take part in a matrix multiply: every parameter of 2 or more dimensions outside an embedding
    lookup (a head tied to the embedding counts once, for its multiply). For any model: SwiGLU, grouped-query
    attention and Hugging Face's Conv1D count as built."""
    weights = {id(p): p.numel() for m in model.modules() if not isinstance(m, nn.Embedding)
               for p in m.parameters(recurse=False) if p.dim() >= 2}
    return sum(weights.values())


def flops_per_token(cfg: GPTConfig, model: nn.Module) -> float:
    """Training FLOPs per token of `model` shaped by `cfg` (the simulator's formula, ``training_flops_per_token``); a
    mixture of experts counts the weights a token meets: top_k of its n_experts experts."""
    active = matmul_params(model) - idle_expert_params(cfg, model)
    return training_flops_per_token(active, cfg.n_layer, cfg.n_embd, cfg.block_size)
