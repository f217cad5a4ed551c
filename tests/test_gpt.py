"""The example GPT — layer shapes, the loss at init, the hooks, checkpointing, the optimizer."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from exact_compare import assert_exact
from gpt import GPT, GPTConfig, OptimConfig, flops_per_token, lr_factor, matmul_params
from one_process import as_float64

from lightning_bfpp.contract.hooks import check_hooks
from lightning_bfpp.sim import Model

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


def batch(b=4, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (b, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def test_layers_chain_with_documented_shapes():
    torch.manual_seed(0)
    model = GPT(CFG)
    check_hooks(model)
    layers = model.pipeline_layers()
    assert len(layers) == CFG.n_layer + 2
    x, _ = batch()
    h = layers[0](x)
    assert h.shape == (4, 16, 32)
    for block in layers[1:-1]:
        h = block(h)
        assert h.shape == (4, 16, 32)
    logits = layers[-1](h)
    assert logits.shape == (4, 16, 256)
    assert torch.equal(logits, model(x))


def test_loss_at_init_is_uniform_over_bytes():
    torch.manual_seed(0)
    model = GPT(CFG)
    loss = model._loss(batch())
    assert abs(loss.item() - math.log(256)) < 0.1


def test_attention_is_causal():
    torch.manual_seed(0)
    model = as_float64(GPT(CFG)).eval()  # float64: the past's logits must not move beyond rounding
    x, _ = batch()
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256  # change the future only
    assert_exact(model(x)[:, :10], model(y)[:, :10], "logits of the past")


def test_activation_checkpointing_gives_the_same_gradients():
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**CFG.__dict__, "activation_checkpointing": ckpt}))
        model._loss(batch()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_tied_embedding_is_a_weight_shared_by_the_first_and_last_stage():
    from itertools import chain

    from lightning_bfpp.layout.cut import plan_stages
    from lightning_bfpp.layout.tied import find_shared_weights

    def shared(model, num_stages):
        layers = model.pipeline_layers()
        stages = plan_stages(model, layers, num_stages)
        return find_shared_weights(dict(zip(chain(*stages), layers)), stages)

    tied = GPT(GPTConfig(**{**CFG.__dict__, "tie_weights": True}))
    assert tied.head.lm_head.weight is tied.embedding.tok.weight
    assert shared(tied, 4) == [{0: "embedding.tok.weight", 3: "head.lm_head.weight"}]
    assert shared(tied, 1) == []  # both uses in one stage: an ordinary shared parameter
    assert shared(GPT(CFG), 4) == []


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_optimizer_and_schedule(name):
    model = GPT(CFG, OptimConfig(name=name, lr=0.01, warmup_steps=10))
    model.trainer = SimpleNamespace(max_steps=100, estimated_stepping_batches=100)
    conf = model.configure_optimizers()
    opt, _ = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert type(opt).__name__ == {"adamw": "AdamW", "sgd": "SGD"}[name]
    assert conf["lr_scheduler"]["interval"] == "step"
    assert opt.param_groups[1]["weight_decay"] == 0.0 and all(p.dim() < 2 for p in opt.param_groups[1]["params"])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001)  # warmup step 0: lr / 10
    with pytest.raises(ValueError, match="optim.name='lion'"):
        GPT(CFG, OptimConfig(name="lion")).configure_optimizers()


def test_lr_factor_warms_up_then_decays_to_the_floor():
    f = [lr_factor(s, warmup=10, total=100, min_ratio=0.1) for s in range(120)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[100] == pytest.approx(0.1) and f[119] == pytest.approx(0.1)


def test_a_few_steps_overfit_one_batch():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    b = batch()
    first = model._loss(b).item()
    for _ in range(30):
        loss = model._loss(b)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 1.0


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_is_the_simulators_formula_on_the_built_model(tied):
    cfg = dataclasses.replace(CFG, tie_weights=tied)
    model = GPT(cfg)
    h, v = cfg.n_embd, cfg.vocab_size
    assert matmul_params(model) == 12 * h * h * cfg.n_layer + v * h  # q, k, v, proj, MLP (4h, back) per block; head
    want = Model(cfg.n_layer, cfg.n_head, h, cfg.block_size, v).flops_per_token()
    assert flops_per_token(cfg, model) == want == 6 * matmul_params(model) + 12 * cfg.n_layer * h * cfg.block_size


def test_the_example_model_imports_public_names_only():
    """examples/gpt.py and examples/moe.py, the model a user copies, reach bfpp through its public modules only (the
    package's top level, ``modeling``, ``sim``), never an internal path."""
    import ast
    from pathlib import Path

    public = {"lightning_bfpp", "lightning_bfpp.modeling", "lightning_bfpp.sim"}
    examples = Path(__file__).resolve().parents[1] / "examples"
    for name in ("gpt.py", "moe.py"):
        tree = ast.parse((examples / name).read_text())
        used = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        used |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        bfpp = {m for m in used if m.split(".")[0] == "lightning_bfpp"}
        assert bfpp and bfpp <= public, (name, sorted(bfpp - public))
