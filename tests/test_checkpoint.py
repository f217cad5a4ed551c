"""Sharded checkpoints: exact resume, resume in other layouts, export, safe saving."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from exact_compare import assert_exact
from exact_model import StackNet, reference_eval
from launch import merged, run_lightning
from one_process import as_float64

import lightning_bfpp.checkpoint as ckpt

STEPS = 6


def _cfg(pp, loops, m, opt, **kw):
    return {"pp": pp, "loops": loops, "m": m, "steps": STEPS, "opt": opt, **kw}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    # original layouts, uninterrupted, saving every 3 steps: pp=2 loops=2 at dp=1 (world 2) and dp=2 (world 4)
    w2 = [_cfg(2, 2, 2, opt, save_every=3, save_dir=str(root / f"dp1-{opt}")) for opt in ("sgd", "adamw")]
    # a tied weight: one copy (pp=1, dp=2) and a copy per end stage (pp=2 loops=2, dp=1), saving at step 3
    w2 += [_cfg(1, 1, 1, "adamw", tied=True, save_every=3, save_dir=str(root / "tied-one-copy")),
           _cfg(2, 2, 2, "adamw", tied=True, save_every=3, save_dir=str(root / "tied-dp1"))]
    # async_save: the same training, its checkpoints written in the background
    w2 += [_cfg(2, 2, 2, "adamw", save_every=3, save_dir=str(root / "async"), async_save=True)]
    r2 = run_lightning(root / "w2", 2, w2)
    out["async"] = r2[4]
    out["dp1"] = dict(zip(("sgd", "adamw"), r2[0:2]))
    out["tied-dp1"] = r2[3]
    ckpt.export(root / "dp1-sgd" / "step=6.ckpt", root / "exported.ckpt")  # a plain file, evaluated at dp=2 below
    w4 = [_cfg(2, 2, 2, opt, save_every=3, save_dir=str(root / f"dp2-{opt}")) for opt in ("sgd", "adamw")]
    w4 += [_cfg(2, 2, 2, opt, resume=str(root / f"dp2-{opt}" / "step=3.ckpt")) for opt in ("sgd", "adamw")]
    w4 += [_cfg(4, 1, 4, opt, resume=str(root / f"dp1-{opt}" / "step=3.ckpt")) for opt in ("sgd", "adamw")]
    w4 += [_cfg(2, 2, 2, opt, sharding="full", resume=str(root / f"dp1-{opt}" / "step=3.ckpt"))
           for opt in ("sgd", "adamw")]
    w4 += [{"pp": 2, "loops": 2, "m": 2, "eval_ckpt": str(root / "exported.ckpt")}]
    w4 += [_cfg(2, 2, 2, "adamw", tied=True),
           _cfg(2, 2, 2, "adamw", tied=True, resume=str(root / "tied-one-copy" / "step=3.ckpt"))]
    w4 += [_cfg(2, 2, 2, "adamw", resume=str(root / "async" / "step=3.ckpt"))]
    # (w4 must wait for w2's checkpoints, so it is a second launch)
    r4 = run_lightning(root / "w4", 4, w4)
    out["eval-exported"] = r4[8]
    out["tied-dp2"], out["tied-copies-from-one"] = r4[9], r4[10]
    out["dp2-from-async"] = r4[11]
    out["dp2"] = dict(zip(("sgd", "adamw"), r4[0:2]))
    out["dp2-resumed"] = dict(zip(("sgd", "adamw"), r4[2:4]))
    out["pp4-from-dp1"] = dict(zip(("sgd", "adamw"), r4[4:6]))
    out["dp2-from-dp1"] = dict(zip(("sgd", "adamw"), r4[6:8]))
    w1 = [_cfg(1, 1, 1, opt, resume=str(root / f"dp1-{opt}" / "step=3.ckpt")) for opt in ("sgd", "adamw")]
    w1 += [_cfg(1, 1, 1, "adamw", tied=True, resume=str(root / "tied-dp1" / "step=3.ckpt"))]
    r1 = run_lightning(root / "w1", 1, w1)
    out["pp1-from-dp1"] = dict(zip(("sgd", "adamw"), r1[0:2]))
    out["tied-one-from-copies"] = r1[2]
    out["root"] = root
    return out


def _compare(resumed, original):
    """The resumed run's last 3 losses and its parameters equal the uninterrupted run's (float64,
    ``exact_compare``)."""
    assert all(r["losses"] == resumed[0]["losses"] for r in resumed)  # same on every rank
    got, want = resumed[0]["losses"], original[0]["losses"][3:]
    assert len(got) == 3, got
    assert_exact(got, want, "train_loss")
    assert_exact(merged(resumed), merged(original), "params")


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_exact_resume_same_layout(runs, opt):
    """6 steps uninterrupted == 3 steps, checkpoint, resume, 3 steps (pp=2, loops=2, dp=2)."""
    _compare(runs["dp2-resumed"][opt], runs["dp2"][opt])


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("layout", ["pp4-from-dp1", "pp1-from-dp1", "dp2-from-dp1"])
def test_resume_in_another_layout(runs, layout, opt):
    """A pp=2 loops=2 dp=1 checkpoint continues at pp=4 loops=1, in one process, and at dp=2."""
    _compare(runs[layout][opt], runs["dp1"][opt])


@pytest.mark.parametrize("resumed, original",
                         [("tied-copies-from-one", "tied-dp2"), ("tied-one-from-copies", "tied-dp1")])
def test_tied_weight_resumes_across_layouts(runs, resumed, original):
    """A tied weight saved with one copy (one stage) continues with a copy per stage, and back (AdamW state
    included: each copy reads the state saved under the tied weight's other name)."""
    want = runs[original]
    if resumed == "tied-one-from-copies":  # one copy: the model lists the tied matrix once, as embed.weight
        want = [{**r, "params": {k: v for k, v in r["params"].items() if k != "unembed.weight"}} for r in want]
    _compare(runs[resumed], want)


def test_background_saves_resume_exactly(runs):
    """async_save=True trains as before, writes complete checkpoints (the last one waited for at the end of fit), and
    the step-3 one resumes at dp=2 to the uninterrupted run."""
    a, b = merged(runs["async"]), merged(runs["dp1"]["adamw"])
    assert runs["async"][0]["losses"] == runs["dp1"]["adamw"][0]["losses"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    for step in (3, 6):
        folder = runs["root"] / "async" / f"step={step}.ckpt"
        ckpt.check_path(folder)  # manifest, files and sizes
        assert ckpt.read_meta(folder)["global_step"] == step
    _compare(runs["dp2-from-async"], runs["dp1"]["adamw"])


def test_export_loads_strict_and_gives_the_same_loss(runs, tmp_path):
    folder = runs["root"] / "dp1-adamw" / "step=6.ckpt"
    out = tmp_path / "model.ckpt"
    ckpt.main([str(folder), str(out)])
    model = as_float64(StackNet())  # the run's precision ("64-true")
    model.load_state_dict(torch.load(out, weights_only=False)["state_dict"], strict=True)
    trained = merged(runs["dp1"]["adamw"])
    assert max((model.state_dict()[k] - trained[k]).abs().max().item() for k in trained) == 0.0
    assert reference_eval(model.state_dict(), 1, 16)[0] == reference_eval(trained, 1, 16)[0]
    loaded = StackNet.load_from_checkpoint(out)  # hyper-parameters travel with the export
    assert loaded.opt == "adamw"


def test_plain_file_loads_into_a_pipelined_layout(runs):
    """trainer.validate(ckpt_path=exported file) at pp=2 x dp=2: the weights and the loss of the export."""
    ranks = runs["eval-exported"]
    exported = torch.load(runs["root"] / "exported.ckpt", weights_only=False)["state_dict"]
    got = merged(ranks)
    assert got.keys() == exported.keys()
    assert max((got[k] - exported[k]).abs().max().item() for k in got) == 0.0
    expected, _ = reference_eval(exported, 2, 8, limit=2)
    assert_exact([r["val_loss"] for r in ranks], [expected] * len(ranks), "val_loss")


def test_a_failed_save_is_never_a_checkpoint_and_leaves_nothing(tmp_path, monkeypatch):
    """A save that fails half-way (not for want of storage: its error comes out as it is) never shows under its name,
    and its hidden partial folder is removed."""
    target = tmp_path / "step=3.ckpt"

    def crash(state, storage_writer):
        storage_writer.path.mkdir(parents=True)
        (storage_writer.path / "__0_0.distcp").write_bytes(b"partial")
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(RuntimeError, match="killed mid-save"):
        ckpt.save(target, {"state_dict": {"w": torch.zeros(2)}}, {"global_step": 3})
    assert not target.exists() and not ckpt.is_sharded(target)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.load(target, StackNet(), [])


def test_a_background_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """async_save: a complete background save, then one whose write dies half-way: the error comes out at the
    next step boundary (`raise_failure`) or wait, the folder under the name is still the previous, complete one, and
    the partial folder was removed in the background."""
    from concurrent.futures import Future

    target, saves = tmp_path / "last.ckpt", ckpt.BackgroundSaves()
    ckpt.save(target, {"state_dict": {"w": torch.ones(2)}}, {"global_step": 3}, background=saves)
    saves.wait()
    ckpt.check_path(target)

    def dies(state, storage_writer, process_group=None):
        storage_writer.path.mkdir(parents=True)
        (storage_writer.path / "__0_0.distcp").write_bytes(b"partial")
        failed = Future()
        failed.set_exception(RuntimeError("killed mid-write"))
        return failed

    monkeypatch.setattr(dcp, "async_save", dies)
    ckpt.save(target, {"state_dict": {"w": torch.zeros(2)}}, {"global_step": 6}, background=saves)
    while saves.under_way:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="killed mid-write"):
        saves.raise_failure()
    saves.raise_failure()  # raised once
    saves.close()
    ckpt.check_path(target)
    assert ckpt.read_meta(target)["global_step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
