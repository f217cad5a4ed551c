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
BRIDGES = {"_private/pipelining.py", "_private/torch_fast_paths.py", "_private/torch_api.py",
           "_private/lightning_api.py", "_private/ring_attention.py"}  # lightning_bfpp/_private/
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

    import lightning_bfpp._private.torch_fast_paths  # noqa: F401  (installs the check)

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


# ---- the per-hook bookkeeping bridges (``skip_per_hook_bookkeeping_in_place``), each against Lightning's own path ----

@pytest.fixture
def lightnings_bookkeeping():
    """Lightning's own functions in place for the test, whatever an earlier test installed; the bridges (as a
    strategy's setup leaves them) afterwards."""
    from lightning_bfpp._private.lightning_api import restore_per_hook_bookkeeping, skip_per_hook_bookkeeping_in_place

    restore_per_hook_bookkeeping()
    yield
    skip_per_hook_bookkeeping_in_place()


def _signature_cases():
    import functools

    from typing_extensions import override

    def decorated(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return fn(*args, **kwargs)
        return inner

    class Hooks:
        def two(self, batch, batch_idx): ...
        def one(self, batch): ...
        def star(self, *args): ...
        def star_after(self, batch, *args, **kwargs): ...
        def renamed(self, x, y, z=1): ...
        def iterator(self, dataloader_iter): ...
        def keyword_only(self, batch, *, batch_idx=0): ...
        def positional_only(self, batch, batch_idx, /): ...
        @decorated
        def wrapped(self, batch): ...
        def marked(self, batch, batch_idx): ...
        @override
        def overridden(self, batch, batch_idx): ...
        def partial_like(self, batch): ...
        @staticmethod
        def static(batch, batch_idx): ...
        @classmethod
        def of_class(cls, batch): ...
        def __call__(self, batch, batch_idx): ...
    Hooks.marked.__signature__ = inspect.Signature()  # getfullargspec reads it
    Hooks.partial_like._partialmethod = functools.partialmethod(Hooks.two, None)  # and this (Python 3.11)

    hooks = Hooks()
    return [hooks.two, hooks.one, hooks.star, hooks.star_after, hooks.renamed, hooks.iterator, hooks.keyword_only,
            hooks.positional_only, hooks.wrapped, hooks.marked, hooks.overridden, hooks.partial_like, hooks.static,
            hooks.of_class, hooks,
            lambda batch, batch_idx: None, functools.partial(Hooks.two, hooks), print, [].append]


import inspect  # noqa: E402  (the cases above)


def _answer(fn, *args):
    try:
        return fn(*args)
    except Exception as error:  # the same error type where Lightning's raises
        return type(error)


def test_hook_signatures_read_once_answer_as_lightnings(lightnings_bookkeeping):
    """``hook_signatures_read_once_in_place``: the same answer as Lightning's for every kind of callable and question
    (read twice: the kept reading too), and a method given new code is read anew."""
    from lightning.pytorch.core import module as core_module
    from lightning.pytorch.loops import training_epoch_loop
    from lightning.pytorch.utilities import signature_utils

    from lightning_bfpp._private.lightning_api import hook_signatures_read_once_in_place

    lightnings = signature_utils.is_param_in_hook_signature
    questions = [(param, explicit, min_args) for param in ("batch_idx", "dataloader_iter", "batch")
                 for explicit in (False, True) for min_args in (None, 1, 2, 3)]
    cases = _signature_cases()
    expected = [[_answer(lightnings, fn, *q) for q in questions] for fn in cases]
    hook_signatures_read_once_in_place()
    hook_signatures_read_once_in_place()  # once only
    ours = signature_utils.is_param_in_hook_signature
    assert ours is not lightnings and ours.__wrapped__ is lightnings
    assert core_module.is_param_in_hook_signature is ours and training_epoch_loop.is_param_in_hook_signature is ours
    for _ in range(2):
        assert [[_answer(ours, fn, *q) for q in questions] for fn in cases] == expected

    class Changing:
        def step(self, batch): ...
    changing = Changing()
    assert not ours(changing.step, "batch_idx", min_args=2)
    Changing.step.__code__ = (lambda self, batch, batch_idx: None).__code__
    assert ours(changing.step, "batch_idx", min_args=2) and lightnings(changing.step, "batch_idx", min_args=2)


def test_pass_through_profiles_are_lightnings_ranges(lightnings_bookkeeping):
    """``pass_through_profiles_without_generators_in_place``: PassThroughProfiler's range gives its name and lets
    errors through, as Lightning's; a subclass's start and stop are still called (Lightning's own range)."""
    from lightning.pytorch.profilers import PassThroughProfiler

    from lightning_bfpp._private.lightning_api import pass_through_profiles_without_generators_in_place

    def use(profiler):
        with profiler.profile("action") as name:
            seen = name
        with pytest.raises(KeyError, match="inside"), profiler.profile("failing"):
            raise KeyError("inside")
        return seen

    class Recording(PassThroughProfiler):
        def __init__(self):
            super().__init__()
            self.calls = []

        def start(self, action_name):
            self.calls.append(("start", action_name))

        def stop(self, action_name):
            self.calls.append(("stop", action_name))

    expected = (use(PassThroughProfiler()), use(recording := Recording()), recording.calls)
    pass_through_profiles_without_generators_in_place()
    pass_through_profiles_without_generators_in_place()  # once only
    assert getattr(PassThroughProfiler.profile, "_bfpp_passing", False)
    assert (use(PassThroughProfiler()), use(recording := Recording()), recording.calls) == expected
    assert expected[0] == "action" and expected[2] == [("start", "action"), ("stop", "action"), ("start", "failing"),
                                                       ("stop", "failing")]


def test_a_trainers_hooks_logs_and_losses_are_unchanged_by_the_bookkeeping_bridges(lightnings_bookkeeping):
    """Through a Trainer (strategy="auto", a callback logging, a profiler-less and a simple profiler run): the name
    every hook sees as ``_current_fx_name``, the hooks called, the logged values and losses are Lightning's."""
    import lightning as L
    import torch
    from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bfpp._private.lightning_api import restore_per_hook_bookkeeping, skip_per_hook_bookkeeping_in_place

    class Net(L.LightningModule):
        def __init__(self, record):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)
            self.record = record

        def training_step(self, batch, batch_idx):
            self.record.append(("training_step", self._current_fx_name))
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch, batch_idx):
            self.record.append(("validation_step", self._current_fx_name))
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def on_train_batch_start(self, batch, batch_idx):
            self.record.append(("on_train_batch_start", self._current_fx_name))

        def on_before_optimizer_step(self, optimizer):
            self.record.append(("on_before_optimizer_step", self._current_fx_name))

        def configure_optimizers(self):
            self.record.append(("configure_optimizers", self._current_fx_name))
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Watch(L.Callback):
        def __init__(self, record):
            self.record = record

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.record.append(("cb.on_train_batch_end", pl_module._current_fx_name))
            pl_module.log("from_callback", float(batch_idx), on_step=True, on_epoch=True)

        def on_validation_epoch_end(self, trainer, pl_module):
            self.record.append(("cb.on_validation_epoch_end", pl_module._current_fx_name))

        def on_train_epoch_end(self, trainer, pl_module):
            self.record.append(("cb.on_train_epoch_end", pl_module._current_fx_name))

    def fit(profiler) -> tuple:
        torch.manual_seed(1)
        data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        record: list = []
        net = Net(record)
        trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, accelerator="cpu", devices=1, profiler=profiler,
                            callbacks=[Watch(record)], limit_val_batches=2)
        trainer.fit(net, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        return record, metrics, [p.detach().clone() for p in net.parameters()], net._current_fx_name

    for profiler in (None, SimpleProfiler()):
        without = fit(profiler)
        skip_per_hook_bookkeeping_in_place()
        assert getattr(PassThroughProfiler.profile, "_bfpp_passing", False)
        try:
            with_bridges = fit(profiler)
        finally:
            restore_per_hook_bookkeeping()
        assert with_bridges[0] == without[0] and with_bridges[1] == without[1] and with_bridges[3] == without[3]
        assert all(torch.equal(a, b) for a, b in zip(with_bridges[2], without[2]))
        assert ("cb.on_train_batch_end", "on_train_batch_end") in without[0] and "from_callback_epoch" in without[1]


def test_stage_tensor_descriptions_are_made_when_formatted():
    """torch's stage module describes a forward's outputs (``map_debug_info``) for a debug line on every forward: bfpp
    makes the description only when it is formatted; the log line and an error message read the same text."""
    import logging

    import torch
    from torch.distributed.pipelining import _debug
    from torch.distributed.pipelining import stage as torch_stage

    import lightning_bfpp._private.torch_fast_paths  # noqa: F401  (installs the lazy description)

    t = torch.randn(2, 3, requires_grad=True)
    values = [t, (t, t.detach()), {"x": t, "n": 3}, [t.double(), None], 1.5, "text"]

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(self.format(record))

    keep = Keep()
    torch_stage.logger.addHandler(keep)
    level = torch_stage.logger.level
    torch_stage.logger.setLevel(logging.DEBUG)
    try:
        for value in values:
            ours, theirs = torch_stage.map_debug_info(value), _debug.map_debug_info(value)
            assert str(ours) == str(theirs) and repr(ours) == repr(theirs) and f"{ours}" == f"{theirs}"
            assert f"args: {ours}\n" == f"args: {theirs}\n"  # the failed forward's message
            torch_stage.logger.debug("%s Forwarded chunk %s, outputs: %s", "[Stage 0]", 0, ours)
            torch_stage.logger.debug("%s Forwarded chunk %s, outputs: %s", "[Stage 0]", 0, theirs)
            assert keep.lines[-1] == keep.lines[-2]
    finally:
        torch_stage.logger.removeHandler(keep)
        torch_stage.logger.setLevel(level)
    assert len(keep.lines) == 2 * len(values)


def test_inputs_split_into_micro_batches_as_torch_splits_them():
    """``_split_plain_tensors`` (torch's runtime's input split): for positional plain tensors the same micro-batches as
    torch's ``split_args_kwargs_into_chunks`` (views of the same storage, offsets, shapes, strides, gradient flags,
    retained gradients on a leaf's parts); anything else is torch's own result."""
    import torch
    from torch.distributed.pipelining import microbatch, schedules

    from lightning_bfpp._private import torch_fast_paths

    assert schedules.split_args_kwargs_into_chunks is torch_fast_paths._split_plain_tensors
    torchs = microbatch.split_args_kwargs_into_chunks

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    def described(value):
        if isinstance(value, torch.Tensor):
            return (type(value), value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                    value.stride(), value.requires_grad, value.is_leaf, value.retains_grad,
                    value._base is not None, value.dtype)
        if isinstance(value, (tuple, list)):
            return (type(value), [described(v) for v in value])
        if isinstance(value, dict):
            return (dict, {k: described(v) for k, v in value.items()})
        return value

    x, y = torch.randn(8, 3), torch.arange(8)
    nonleaf = leaf(6, 2) * 2
    cases = [((x,), None, 1), ((x,), {}, 4), ((x, y), None, 8), ((x, torch.randn(3, 2)), None, 4),
             ((leaf(8, 3),), None, 4), ((nonleaf,), None, 3), ((x,), None, 16), ((x, 1.5), None, 2),
             ((x,), {"mask": y}, 2), ((torch.nn.Parameter(torch.randn(4, 2)),), None, 2), ((), {"a": x}, 2),
             ((torch.zeros(0, 2),), None, 1)]
    for args, kwargs, chunks in cases:
        ours = _answer(torch_fast_paths._split_plain_tensors, args, kwargs, chunks)
        theirs = _answer(torchs, args, kwargs, chunks)
        assert described(ours) == described(theirs), (args, kwargs, chunks)
    assert len(torch_fast_paths._split_plain_tensors((x,), None, 4)[0]) == 4


def test_stage_inputs_flatten_as_torch_flattens_them():
    """``_flatten_plain`` (the stage's ``flatten_args``): the list torch's pytree flattening gives, for every input."""
    import torch
    from torch.distributed.pipelining import _utils
    from torch.distributed.pipelining import stage as torch_stage

    from lightning_bfpp._private import torch_fast_paths

    assert torch_stage.flatten_args is torch_fast_paths._flatten_plain
    x, y = torch.randn(2, 3), torch.randn(4)
    for value in [(x,), (x, y), (), {}, {"a": x}, (x, 2), (x, (y,)), [x, y], (torch.nn.Parameter(y),), x, None,
                  ({"a": x},)]:
        ours, theirs = torch_fast_paths._flatten_plain(value), _utils.flatten_args(value)
        assert type(ours) is type(theirs) is list and len(ours) == len(theirs)
        assert all(a is b for a, b in zip(ours, theirs)), value
        ours = torch_fast_paths._flatten_plain(value, detach=True)
        theirs = _utils.flatten_args(value, detach=True)
        assert type(ours) is type(theirs) and len(ours[1]) == len(theirs[1])
