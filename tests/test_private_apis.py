"""Private torch / Lightning / torchmetrics APIs stay in their bridge modules (read from the sources, no imports run),
the import-time version check names the installed version and the tested range, and pyproject.toml states the same
ranges as the check (lightning_bfpp/_private/versions.py)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

from lightning_bfpp._private.versions import ALLOW_UNTESTED, SUPPORTED, check_version

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "lightning_bfpp"
BRIDGES = {"_private/pipelining.py", "_private/torch_api.py", "_private/lightning_api.py",
           "_private/ring_attention.py"}  # lightning_bfpp/_private/
PRIVATE_ATTRIBUTES = {"_forward_cache", "_update_count", "_computed", "_reductions", "_optimizer", "_timeout",
                      "_local_tensor", "_get_default_store", "_StorageInfo", "_get_layout", "_PipelineScheduleRuntime",
                      "_Action", "_ComputationType", "_device_mesh", "_data_source", "_max_depth",
                      "_summarize_kwargs"}
# `self._optimizer` / `self._device_mesh`: the class's own (or its strategy base's)
SELF_OK = {"_optimizer", "_device_mesh"}
LIBRARIES = ("torch", "lightning", "torchmetrics", "pytorch_lightning")


def private_uses(source: str) -> list[str]:
    """Private names of the libraries that `source` imports, and the known private attributes it reads or writes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            for module in modules:
                if module.split(".")[0] in LIBRARIES and (
                        any(part.startswith("_") for part in module.split("."))
                        or any(n.startswith("_") and not n.startswith("__") for n in names)):
                    found.append(module + (f": {', '.join(names)}" if names else ""))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr") and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in PRIVATE_ATTRIBUTES:
            found.append(node.args[1].value)  # getattr(obj, "_private")
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES and not (
                node.attr in SELF_OK and isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append(node.attr)
    return found


MODULES = [pytest.param(p, id=str(p.relative_to(PKG))) for p in sorted(PKG.rglob("*.py"))
           if str(p.relative_to(PKG)) not in BRIDGES]


@pytest.mark.parametrize("path", MODULES)
def test_private_apis_only_in_the_bridge_modules(path):
    found = private_uses(path.read_text())
    assert not found, (f"{path.relative_to(ROOT)} uses {found}: move them to {sorted(BRIDGES)} (docs/development.md: "
                       "private APIs)")


def test_the_scan_sees_private_imports_and_attributes():
    code = ("from lightning.fabric.utilities.init import _materialize_distributed_module\n"
            "import torch._C._distributed_c10d\nfrom torch.distributed.fsdp._fully_shard import x\n"
            "def f(m, o):\n    m._device_mesh = self._device_mesh\n"
            "    return m._forward_cache, o._optimizer, self._optimizer\n"
            "from torch import nn\nfrom ._private import ok\n"
            "source = getattr(trainer.fit_loop, '_data_source', None)\n")
    assert sorted(private_uses(code)) == sorted([
        "lightning.fabric.utilities.init: _materialize_distributed_module", "torch._C._distributed_c10d",
        "torch.distributed.fsdp._fully_shard: x", "_device_mesh", "_forward_cache", "_optimizer", "_data_source"])


@pytest.mark.parametrize("bridge", sorted(BRIDGES))
def test_bridge_modules_check_the_version_at_import(bridge):
    assert re.search(r'^check_version\("(torch|lightning)"\)$', (PKG / bridge).read_text(), re.M)


@pytest.mark.parametrize("installed", ["2.14.0", "2.14.0a0+git", "2.12.1", "3.0.0"])
def test_unsupported_torch_fails_naming_version_and_range(installed):
    with pytest.raises(ImportError, match=re.escape(f"torch>=2.13,<2.14; this is torch {installed}")):
        check_version("torch", installed)


def test_untested_version_imports_with_a_warning_only_when_allowed(monkeypatch):
    monkeypatch.setenv(ALLOW_UNTESTED, "0")
    with pytest.raises(ImportError, match=f"or set {ALLOW_UNTESTED}=1"):
        check_version("torch", "2.11.0")
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    with pytest.warns(UserWarning, match=re.escape("this is torch 2.11.0. Imported anyway")):
        check_version("torch", "2.11.0")


@pytest.mark.parametrize("distribution,installed", [("torch", "2.13.0+cpu"), ("torch", "2.13.1"),
                                                    ("lightning", "2.6.6"), ("torchmetrics", "1.9.0")])
def test_tested_versions_pass(distribution, installed):
    check_version(distribution, installed)


def test_installed_versions_are_the_tested_ones():
    for distribution in SUPPORTED:
        check_version(distribution)


def test_pyproject_admits_exactly_the_checked_ranges():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for distribution, (lo, hi) in SUPPORTED.items():
        assert f"{distribution}>={lo},<{hi}" in dependencies, (distribution, dependencies)


def test_readme_and_docs_name_no_other_torch_range():
    lo, hi = SUPPORTED["torch"]
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named = set(re.findall(r"torch(?:==|>=)[0-9.,<>=]*[0-9]", page.read_text()))
        assert named <= {f"torch>={lo},<{hi}", "torch==2.13.0"}, (page.name, named)


def test_torch_before_2_13_p2p_warmup_skips_stages_on_the_same_rank():
    """The bridge for torch 2.11's runtime (ALLOW_UNTESTED): its p2p warm-up messaged a neighbour on the same rank."""
    from types import SimpleNamespace

    from lightning_bfpp._private.pipelining import no_p2p_warmup_to_itself

    ops = [SimpleNamespace(group_peer=peer) for peer in (0, 1, 0, 1)]
    stage = SimpleNamespace(group_rank=0, _get_init_p2p_neighbors_ops=lambda: ops)
    no_p2p_warmup_to_itself(stage)
    assert [op.group_peer for op in stage._get_init_p2p_neighbors_ops()] == [1, 1]


def test_the_runtimes_action_ranges_are_opened_only_under_a_profiler():
    """torch's runtime wraps every action in ``record_function``: bfpp skips it when no profiler listens (a few
    microseconds an action, for nothing), and a running profiler still records each action's range."""
    import torch
    from torch.distributed.pipelining import schedules
    from torch.profiler import ProfilerActivity, profile

    import lightning_bfpp._private.pipelining  # noqa: F401  (installs the check)

    with schedules.record_function("PP:0F0") as handle:
        assert handle is None  # nothing opened
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with schedules.record_function("PP:0F0"):
            torch.ones(2).sum()
    assert "PP:0F0" in {e.name for e in prof.events()}


def _logged(reduce_fx="mean", steps=2):
    """A Lightning result collection after `steps` logged values of `train_loss` (as self.log makes them)."""
    import torch
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    results = _ResultCollection(training=True)
    for step in range(steps):
        results.log("training_step", "train_loss", torch.tensor(1.5 + step), on_step=True, on_epoch=True,
                    reduce_fx=reduce_fx, batch_size=4)
    return results["training_step.train_loss"]


@pytest.mark.parametrize("reduce_fx", ["mean", "max", "sum"])
def test_logged_values_skip_the_move_only_when_nothing_moves(reduce_fx):
    """``skip_logged_value_moves_in_place``: a logged value already on the device is left as Lightning's own ``to``
    leaves it (same tensors, same values); to another device, Lightning's ``to`` moves every tensor as before."""
    import copy

    import torch
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    from lightning_bfpp._private.lightning_api import skip_logged_value_moves_in_place

    lightnings_to = _ResultMetric.to
    skip_logged_value_moves_in_place()
    skip_logged_value_moves_in_place()  # once only
    assert getattr(_ResultMetric.to, "_bfpp_in_place", False)
    if getattr(lightnings_to, "_bfpp_in_place", False):  # installed earlier in this process: reach Lightning's own
        lightnings_to = _ResultMetric.to.__wrapped__
    assert not getattr(lightnings_to, "_bfpp_in_place", False)

    metric = _logged(reduce_fx)
    metric.compute()  # a computed value is cached on it too
    reference = lightnings_to(copy.deepcopy(metric), torch.device("cpu"))
    assert metric.to(torch.device("cpu")) is metric  # returned at once ...
    tensors = {k: v for k, v in metric.__dict__.items() if isinstance(v, torch.Tensor)}
    assert tensors.keys() == {k for k, v in reference.__dict__.items() if isinstance(v, torch.Tensor)}
    for name, tensor in tensors.items():  # ... and what Lightning's walk would have left
        assert torch.equal(tensor, reference.__dict__[name]) and tensor.device == reference.__dict__[name].device
    moved = metric.to(torch.device("meta"))  # something to move: Lightning's own
    assert all(v.device.type == "meta" for v in moved.__dict__.values() if isinstance(v, torch.Tensor))
    assert moved.value.device.type == "meta" and all(t.device.type == "meta" for t in moved._defaults.values())


def test_a_trainers_logged_loss_is_unchanged_by_the_skipped_move():
    """Through a Trainer (strategy="auto"), the loss logged every step and its epoch mean are what they are with
    Lightning's own move."""
    import lightning as L
    import torch
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bfpp._private.lightning_api import skip_logged_value_moves_in_place

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)
            self.seen = []

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            self.seen.append(float(self.trainer.callback_metrics.get("train_loss_step", float("nan"))))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit() -> tuple[list[float], float]:
        torch.manual_seed(1)
        data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        net = Net()
        trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, accelerator="cpu", devices=1)
        trainer.fit(net, DataLoader(data, batch_size=8))
        return net.seen, float(trainer.callback_metrics["train_loss_epoch"])

    skip_logged_value_moves_in_place()
    patched = _ResultMetric.to
    with_skip = fit()
    _ResultMetric.to = patched.__wrapped__  # Lightning's own
    try:
        without = fit()
    finally:
        _ResultMetric.to = patched
    assert with_skip == without
