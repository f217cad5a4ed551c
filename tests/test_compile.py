"""Compiled layers (BFPPStrategy(compile=True)): torch.compile (inductor on CPU) per pipeline layer trains as eager,
names and checkpoints unchanged, and no layer is compiled again after step 2."""

from __future__ import annotations

import pytest
import torch
from exact_compare import assert_exact
from launch import run_lightning

from lightning_bfpp._private.torch_api import check_compile

LAYOUT = {"pp": 2, "loops": 2, "m": 2, "steps": 4, "opt": "sgd"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch of 2 processes: eager, compiled, compiled with activation checkpointing (pp=2 x loops=2)."""
    return run_lightning(tmp_path_factory.mktemp("compile"), 2,
                         [LAYOUT, {**LAYOUT, "compile": True}, {**LAYOUT, "compile": True, "ac": True}], timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("index", [1, 2], ids=["compiled", "compiled+activation_checkpointing"])
def test_compiled_layers_train_as_eager(runs, index):
    eager, compiled = runs[0][0], runs[index][0]
    assert compiled["params"].keys() == eager["params"].keys()  # the model's own names: checkpoints unchanged
    assert_exact(compiled["params"], eager["params"], "params")  # float64 both (run_exact's precision)
    assert_exact(compiled["losses"], eager["losses"], "train_loss")


@pytest.mark.slow
@pytest.mark.parametrize("index", [1, 2], ids=["compiled", "compiled+activation_checkpointing"])
def test_no_layer_is_compiled_again_after_step_2(runs, index):
    for rank in runs[index]:
        stats = rank["stats"]
        assert stats["compiled_graphs"] >= 1  # the layers did go through torch.compile
        assert stats["recompiled_graphs"] == 0
    assert "compiled_graphs" not in runs[0][0]["stats"]  # eager: nothing to count


def test_compile_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-bfpp")
    with pytest.raises(RuntimeError, match=r"compile=True \(Hydra: schedule.compile=true\) on CPU needs a C\+\+ "
                                           r"compiler.*no-such-compiler-bfpp.*set compile=False"):
        check_compile("cpu")
    check_compile("cuda")  # no C++ compiler needed for GPU kernels (triton)


def test_the_counter_sees_a_recompile_after_the_warm_up():
    from lightning_bfpp.runtime.instrument import CompileCounter

    torch.compiler.reset()
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    counter = CompileCounter(warmup=2)
    for rows in (2, 2, 2):
        with counter.step():
            fn(torch.ones(rows))
    assert counter.stats() == {"compiled_graphs": 1.0, "recompiled_graphs": 0.0}
    with pytest.warns(UserWarning, match=r"compiled again in training step 4 \(1 graph\(s\); 1 after step 2"):
        with counter.step():
            fn(torch.ones(3))  # a new shape: a new graph
    assert counter.stats() == {"compiled_graphs": 2.0, "recompiled_graphs": 1.0}
