"""A small pipelinable LightningModule and its plain single-process reference (used by the tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from one_process import BatchLoss, as_float64, mean_batch_loss, train
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_bfpp import PipelineHooks, mean_loss
from lightning_bfpp.layout.materialize import seeded_init

DIM, CLASSES, SAMPLES = 16, 5, 256


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Counter(nn.Module):
    """A parameter-free layer with state updated in training-mode forwards (like BatchNorm's running statistics):
    how many forwards it ran and the sum of everything it saw (float64, so the order of the sum hardly matters)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("input_sum", torch.zeros((), dtype=torch.float64))
        self.register_buffer("one", torch.ones(()))

    def forward(self, x):
        if self.training:
            self.calls += 1
            self.input_sum += x.detach().double().sum()
        return x * self.one  # = x, but saves a tensor for backward: activation checkpointing recomputes this layer


class StackNet(PipelineHooks, LightningModule):
    """embed -> blocks -> head; the ~15 lines that make it pipelinable are the three pipeline_* hooks."""

    def __init__(self, n_blocks: int = 6, lr: float = 0.5, opt: str = "sgd", tied: bool = False, counter: bool = False,
                 counted: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.opt, self.counted = lr, opt, counted
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(n_blocks))
        self.unembed = None
        if tied:  # a layer before the head that reuses the input projection's matrix (first and last stage)
            self.unembed = nn.Linear(DIM, DIM, bias=False)
            self.unembed.weight = self.embed.weight
        self.head = nn.Linear(DIM, CLASSES)
        # counters after the input projection (first stage) and before the head (last stage)
        self.counters = nn.ModuleList([Counter(), Counter()]) if counter else None

    def pipeline_layers(self):
        first, last = ([c] for c in self.counters) if self.counters is not None else ([], [])
        tied = [self.unembed] if self.unembed is not None else []
        return [self.embed, *first, *self.blocks, *tied, *last, self.head]

    def pipeline_loss(self, output, target):
        if self.counted:  # targets of -100 are ignored: (the counted targets' summed loss, their number)
            return F.cross_entropy(output, target, ignore_index=-100, reduction="sum"), (target != -100).sum()
        return F.cross_entropy(output, target)

    def forward(self, x):
        return self.pipeline_forward(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = mean_loss(self.pipeline_loss(self(x), y))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", mean_loss(self.pipeline_loss(self(x), y)), sync_dist=True)  # the mean over replicas

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", mean_loss(self.pipeline_loss(self(x), y)), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if self.opt == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr / 50, weight_decay=0.1)
        if self.opt == "adamw_groups":  # nanoGPT's groups: weight decay on matrices, none on biases and norms
            params = [p for p in self.parameters() if p.requires_grad]
            return torch.optim.AdamW([{"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
                                      {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1}],
                                     lr=self.lr / 50)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class LateStackNet(StackNet):
    """StackNet whose layers are built in Lightning's configure_model, on the meta device (a user's large-model
    pattern: no layer exists before the strategy's setup)."""

    def __init__(self, **kwargs):
        LightningModule.__init__(self)
        self.save_hyperparameters()
        self.lr, self.opt, self.counted = kwargs.get("lr", 0.5), kwargs.get("opt", "sgd"), kwargs.get("counted", False)
        self.kwargs, self.embed = kwargs, None

    def configure_model(self):
        if self.embed is not None:  # called again by a later fit/validate on the same model
            return
        with torch.device("meta"):
            net = StackNet(**self.kwargs)
        self.unembed = self.counters = None
        for name, child in reversed(list(net.named_children())):  # the head first: a tied weight's first holder is
            setattr(self, name, child)  # then the later stage's layer (unembed), whose initialization all copies take


def dataset(ignored: bool = False) -> TensorDataset:
    """SAMPLES random inputs and classes; `ignored`: about 40 % of the targets are -100 (not counted by a loss), so
    micro-batches, replicas and batches count different numbers of targets."""
    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(SAMPLES, DIM, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    if ignored:
        y = torch.where(torch.rand(SAMPLES, generator=g) < 0.4, torch.full_like(y, -100), y)
    return TensorDataset(x, y)


def loader(batch_size: int, ignored: bool = False) -> DataLoader:
    return DataLoader(dataset(ignored), batch_size=batch_size, shuffle=False, drop_last=True)


def lightning_batches(global_batch: int, data_parallel: int, ds: TensorDataset | None = None):
    """The global batches Lightning's training sampler (DistributedSampler, shuffle, seed 0) yields from `ds`
    (default: this module's dataset): batch t is the union of every data-parallel replica's t-th batch."""
    ds = dataset() if ds is None else ds
    per_rank = [list(DistributedSampler(ds, num_replicas=data_parallel, rank=r, shuffle=True, seed=0))
                for r in range(data_parallel)]
    b = global_batch // data_parallel
    for t in range(len(per_rank[0]) // b):
        idx = [i for r in range(data_parallel) for i in per_rank[r][t * b : (t + 1) * b]]
        yield ds.tensors[0][idx], ds.tensors[1][idx]


def reference(
    steps: int, global_batch: int, data_parallel: int = 1, accumulate: int = 1, clip: float | None = None,
    seed: int = 0, skip_batches: frozenset[int] = frozenset(), opt: str = "sgd", tied: bool = False,
    counter: bool = False, meta: bool | str = False, counted: bool = False, float64: bool = True,
):
    """Plain single-process training on the same data order (``one_process.train``), in float64 unless `float64` is
    False; returns (final state dict, per-batch losses).
    Batches whose index is in `skip_batches` are drawn (loss recorded) but give no update (accumulate=1).
    `counted`: about 40 % of the targets are ignored and each optimizer step trains the mean over the counted targets
    of all its accumulated batches (each batch's loss recorded as its own mean).
    `meta`: initialized as bfpp initializes a model built on the meta device (seeded per module); "configure_model":
    a LateStackNet, whose modules are registered in another order."""
    torch.manual_seed(seed)
    model = StackNet(opt=opt, tied=tied, counter=counter, counted=counted)
    if meta == "configure_model":
        model = LateStackNet(opt=opt, tied=tied, counter=counter, counted=counted)
        model.configure_model()
    if float64:  # a model built on the meta device under precision="64-true" is initialized in float64 already
        as_float64(model)
    if meta:
        seeded_init(model, seed)
    data = lightning_batches(global_batch, data_parallel, dataset(counted))

    def loss(model: StackNet, batch) -> BatchLoss:
        x, y = batch
        value = model.pipeline_loss(model(x), y)
        return (*value, mean_loss(value).item()) if counted else mean_batch_loss(value)

    losses = train(model, model.configure_optimizers(), ([next(data) for _ in range(accumulate)] for _ in range(steps)),
                   loss, clip=clip, skip=skip_batches)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def reference_eval(state: dict, data_parallel: int, per_replica: int, limit: int | None = None):
    """(mean loss, outputs of data-parallel rank 0) as Lightning's eval loops see them: unshuffled
    DistributedSampler per replica; each step's loss averaged over replicas, then over steps. Computed in the type of
    `state` (float64 for a precision="64-true" run)."""
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    model = StackNet().to(dtype)
    model.load_state_dict(state)
    ds = dataset()
    ds = TensorDataset(ds.tensors[0].to(dtype), ds.tensors[1])
    per_rank = [list(DistributedSampler(ds, num_replicas=data_parallel, rank=r, shuffle=False))
                for r in range(data_parallel)]
    steps = len(per_rank[0]) // per_replica if limit is None else limit
    with torch.no_grad():
        step_losses = []
        for t in range(steps):
            losses = []
            for r in range(data_parallel):
                idx = per_rank[r][t * per_replica : (t + 1) * per_replica]
                losses.append(model.pipeline_loss(model(ds.tensors[0][idx]), ds.tensors[1][idx]).item())
            step_losses.append(sum(losses) / data_parallel)
        outputs = model(ds.tensors[0][per_rank[0]])
    return sum(step_losses) / len(step_losses), outputs
