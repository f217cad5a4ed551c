"""bfpp runs backward inside `training_step` and hands the gradients over in `backward` (GradHandover).
That relies on Lightning's automatic-optimization closure order training_step -> zero_grad -> backward ->
optimizer step; this test fails if a Lightning release changes it (the reason for `lightning<2.7`). One
process, no process group: a few seconds. The multi-process runs with accumulation in test_exactness.py
check the same hand-over under the real strategy."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_bfpp.adapter.handover import GradHandover

ACCUMULATE, STEPS, BATCH, LR = 2, 3, 4, 0.1


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ACCUMULATE * STEPS * BATCH, 5, generator=g),
                         torch.randn(ACCUMULATE * STEPS * BATCH, 1, generator=g))


class Net(LightningModule):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
        self.calls = calls
        self.stepped_grads: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.calls.append("zero_grad")
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def on_before_optimizer_step(self, optimizer):  # after the closure, right before optimizer.step()
        self.calls.append("optimizer_step")
        self.stepped_grads.append([p.grad.clone() for p in self.net.parameters()])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class BackwardInTrainingStep(SingleDeviceStrategy):
    """The bfpp pattern on one device: backward runs in training_step, `backward` only hands over."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__(device=torch.device("cpu"))
        self.calls, self.handover = calls, GradHandover()

    def training_step(self, *args, **kwargs):
        self.calls.append("training_step")
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        with self.handover.capture(params):
            loss = super().training_step(*args, **kwargs)
            loss.backward()
        return loss.detach()

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        self.calls.append("backward")
        self.handover.hand_over(1.0 / self.lightning_module.trainer.accumulate_grad_batches)
        return closure_loss


def _reference() -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Plain torch: the accumulated gradients of every optimizer step, and the final parameters.

    Its own loop, not tests/one_process.train (the exactness tests' float64 reference): it keeps each step's gradients
    before the optimizer's step (train keeps none), in float32 as Lightning's own accumulation computes them, each
    loss scaled by 1/accumulate before its backward (as GradHandover hands them over), not divided after."""
    model = Net([])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = list(DataLoader(_data(), batch_size=BATCH))
    grads = []
    for step in range(STEPS):
        opt.zero_grad()
        for x, y in batches[step * ACCUMULATE:(step + 1) * ACCUMULATE]:
            (nn.functional.mse_loss(model.net(x), y) / ACCUMULATE).backward()
        grads.append([p.grad.clone() for p in model.net.parameters()])
        opt.step()
    return grads, [p.detach().clone() for p in model.net.parameters()]


def test_lightning_closure_order_lets_gradients_computed_in_training_step_reach_the_optimizer():
    calls: list[str] = []
    model = Net(calls)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=BackwardInTrainingStep(calls), max_steps=STEPS,
                      accumulate_grad_batches=ACCUMULATE, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(_data(), batch_size=BATCH))
    window = (["training_step", "zero_grad", "backward"] + ["training_step", "backward"] * (ACCUMULATE - 1)
              + ["optimizer_step"])
    assert calls == window * STEPS, (
        "Lightning's automatic-optimization closure order changed; lightning_bfpp.adapter.handover.GradHandover (and "
        f"the lightning<2.7 pin) assume {window}, got {calls}"
    )
    ref_grads, ref_params = _reference()
    assert len(model.stepped_grads) == STEPS
    for got, ref in zip(model.stepped_grads, ref_grads):
        assert max((a - b).abs().max().item() for a, b in zip(got, ref)) <= 1e-7
    assert max((p - r).abs().max().item() for p, r in zip(model.net.parameters(), ref_params)) <= 1e-7
