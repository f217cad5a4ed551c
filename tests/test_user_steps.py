"""The user's own validation/test/predict steps, torchmetrics, callbacks and loggers under bfpp equal the same
module under strategy="auto" (one process drawing the same batches), on every rank, for pp in {1, 2, 4} x
loops in {1, 2} x dp in {1, 2}. Unit tests of the record/replay pieces need no processes."""

from __future__ import annotations

import pytest
import torch
from exact_compare import EXACT_TOL
from launch import ROOT, Launches
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from user_module import VAL, Classifier

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.adapter.steps import _pack, pipeline_answers_forward, recording_logs

SCRIPT = ROOT / "tests" / "run_user_module.py"
TOL = EXACT_TOL  # both runs in float64 (tests/exact_compare.py)
# world size -> layouts run in one launch (dp = world / pp)
LAUNCHES = {
    1: [{"strategy": "auto", "dp": 1}, {"strategy": "auto", "dp": 2}],
    2: [{"pp": 2, "loops": 1}, {"pp": 2, "loops": 2}, {"pp": 1, "loops": 2}],
    4: [{"pp": 4, "loops": 1}, {"pp": 4, "loops": 2}, {"pp": 2, "loops": 1}, {"pp": 2, "loops": 2}],
    8: [{"pp": 4, "loops": 2}],
}
# synced over data-parallel ranks, so equal to one process whatever dp is (the rest: only at dp=1)
SYNCED = {"val_acc", "val_loss", "val_seen", "val_max_logit", "test_acc", "test_loss", "train_loss", "train_acc",
          "train_acc_epoch", "lr-SGD", "val_samples", "val_auroc"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Launches:
    """Each world size's layouts in one launch: `runs(world)[index]`."""
    return Launches(tmp_path_factory, lambda world, out: (world, LAUNCHES[world]), script=SCRIPT, timeout=300)


# 2 processes in `make test`; the 4- and 8-process launches in the slow set
LAYOUTS = [(w, i, c) if w == 2 else pytest.param(w, i, c, marks=pytest.mark.slow)
           for w, cfgs in LAUNCHES.items() if w > 1 for i, c in enumerate(cfgs)]
IDS = [f"pp{c['pp']}-l{c['loops']}-dp{w // c['pp']}" for w, cfgs in LAUNCHES.items() if w > 1 for c in cfgs]


def _close(got: dict[str, float], want: dict[str, float], keys) -> list:
    return [(k, got.get(k), want.get(k)) for k in keys if k not in got or k not in want or abs(got[k] - want[k]) > TOL]


@pytest.mark.parametrize("world,index,cfg", LAYOUTS, ids=IDS)
def test_user_metrics_callbacks_and_predictions_equal_auto(runs, world, index, cfg):
    dp = world // cfg["pp"]
    ref = runs(1)[dp - 1][0]
    for rank, got in enumerate(runs(world)[index]):
        for phase in ("fit", "validate", "test", "logged"):
            keys = set(ref[phase]) | set(got[phase])
            assert set(got[phase]) == set(ref[phase]), (rank, phase)  # every rank ends with the same keys
            assert not _close(got[phase], ref[phase], keys if dp == 1 else keys & SYNCED), (rank, phase)
        # ModelCheckpoint(monitor="val_acc"), EarlyStopping(monitor="val_acc"), the loop's progress
        assert (got["best_score"], got["stopped_epoch"], got["global_step"]) == \
            (pytest.approx(ref["best_score"], abs=TOL), ref["stopped_epoch"], ref["global_step"])
        assert 0 < got["stopped_epoch"] < 3  # early stopping did act (max_epochs=4)
        # the user's predict_step (argmax): this rank's data-parallel replica's samples
        replica = rank % dp  # the mesh is (pp, dp), dp innermost
        assert torch.equal(got["predictions"], ref["predictions"][replica::dp] if dp > 1 else ref["predictions"])
        assert got["validate"]["val_seen"] == VAL  # summed over replicas once, not once per pipeline rank
        assert got["validate"]["val_samples"] == VAL  # counted by the steps, on every rank at epoch end
    csv, ref_csv = runs(world)[index][0]["csv"], ref["csv"]
    assert [r.keys() for r in csv] == [r.keys() for r in ref_csv]
    columns = set(ref_csv[0]) if dp == 1 else SYNCED & set(ref_csv[0])
    assert "lr-SGD" in columns  # LearningRateMonitor
    for row, want in zip(csv, ref_csv):
        for k in columns:
            same = row[k] == want[k] or (row[k] and want[k] and abs(float(row[k]) - float(want[k])) <= TOL)
            assert same, (k, row, want)


@pytest.mark.slow
def test_replicas_pipeline_ranks_agree_on_local_values(runs):
    """Values not synced over data parallel are the replica's own, the same on each of its pipeline ranks."""
    ranks = runs(4)[3]  # pp=2, dp=2
    for replica in (0, 1):  # global rank = pipeline rank x 2 + replica
        a, b = ranks[replica], ranks[2 + replica]
        assert a["fit"]["val_loss_local"] == b["fit"]["val_loss_local"]
        assert a["fit"]["val_epoch_loss"] == b["fit"]["val_epoch_loss"]  # the steps' list, on every pipeline rank
    assert ranks[0]["fit"]["val_loss_local"] != ranks[1]["fit"]["val_loss_local"]
    assert ranks[0]["fit"]["val_epoch_loss"] != ranks[1]["fit"]["val_epoch_loss"]
    # a step's all_gather and broadcast: the two replicas' losses, replica 0's loss, on every rank as under DDP
    for rank in ranks:
        assert rank["test"]["test_gathered"] == 2  # one entry per replica, not per process
        assert rank["test"]["test_gathered_loss"] == pytest.approx(ranks[0]["test"]["test_gathered_loss"], abs=TOL)
        assert rank["test"]["test_first_replica_loss"] == pytest.approx(ranks[0]["test"]["test_first_replica_loss"],
                                                                        abs=TOL)


# ---- pieces, in one process ------------------------------------------------------------------------------------

def test_forward_answers_only_the_pipeline_inputs():
    model = Classifier()
    x, out = torch.randn(4, 12), torch.randn(4, 4)
    with pipeline_answers_forward(model, x, out, "validation_step"):
        assert model(x) is out and model(x.clone()) is out
        with pytest.raises(ValueError, match="validation_step called self.* other than pipeline_inputs"):
            model(x * 2)
    assert model(x).shape == (4, 4) and model(x) is not out  # the class's forward again


def test_logs_are_recorded_with_metrics_by_attribute():
    model = Classifier()
    with recording_logs(model) as calls:
        model.val_acc(torch.tensor([1, 2]), torch.tensor([1, 3]))
        model.log("val_acc", model.val_acc, prog_bar=True)
        model.log_dict({"a": 1.0, "b": torch.tensor(2.0)}, sync_dist=True)
    packed = _pack(model, calls)
    assert [name for name, *_ in packed] == ["val_acc", "a", "b"]
    ref = packed[0][1]
    assert (ref.attribute, float(ref.forward_cache), ref.update_count) == ("val_acc", 0.5, 1)
    assert packed[0][2]["prog_bar"] and packed[2][2]["sync_dist"]
    with recording_logs(model) as calls:
        from torchmetrics import MeanMetric
        model.log("loose", MeanMetric())
    with pytest.raises(ValueError, match="must be an attribute of Classifier"):
        _pack(model, calls)


class ManualModel(Classifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize("model,precision,match", [
    (ManualModel, "32-true", "automatic_optimization=False"),
    (Classifier, "16-true", "precision='16-true'"),
])
def test_unsupported_modes_fail_before_launch(model, precision, match):
    with pytest.raises(ValueError, match=match):  # fp16: at Trainer(...) already (check_precision_first)
        trainer = Trainer(accelerator="cpu", devices=2, strategy=BFPPStrategy(pipeline_parallel=2),
                          precision=precision, logger=False, enable_progress_bar=False, max_steps=1)
        trainer.fit(model())


def test_default_layout_pipelines_over_every_process():
    strategy = BFPPStrategy()
    Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    assert (strategy.pipeline_parallel, strategy.micro_batches) == (4, 4)
    strategy.check_model(BoringPipeline())  # 3 layers: pp=4 leaves a stage without one -> largest fit, 2
    assert strategy.pipeline_parallel == 2


class BoringPipeline(BoringModel):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    def pipeline_layers(self):
        return list(self.layer)

    def pipeline_loss(self, output, target):
        return output.sum()


def test_skipping_nonfinite_losses_has_a_limit():
    """nonfinite_loss='skip' drops a bad batch, but more than max_consecutive_skips in a row stop the run;
    a finite loss in between resets the count. "stop" raises at once."""
    skip = BFPPStrategy(pipeline_parallel=1, nonfinite_loss="skip", max_consecutive_skips=2).nonfinite
    assert "dropped that batch" in skip.nonfinite("step 1") and "dropped" in skip.nonfinite("step 2")
    skip.finite()  # what a finite step does (training_step)
    skip.nonfinite("step 4")
    skip.nonfinite("step 5")
    with pytest.raises(FloatingPointError, match="step 6: 3 batches in a row .* max_consecutive_skips=2"):
        skip.nonfinite("step 6")
    assert skip.skipped == 5
    with pytest.raises(FloatingPointError, match="step 1: stopping every rank before the optimizer step"):
        BFPPStrategy(pipeline_parallel=1).nonfinite.nonfinite("step 1")
    with pytest.raises(ValueError, match="max_consecutive_skips=0"):
        BFPPStrategy(max_consecutive_skips=0)


def test_nonfinite_eval_values_are_named():
    from lightning_bfpp.adapter.steps import replay

    model = Classifier()
    calls = [("val_loss", torch.tensor(float("nan")), {"sync_dist": True}), ("val_ok", torch.tensor(1.0), {})]
    with recording_logs(model) as replayed:  # stands in for Lightning's log
        assert replay(model, calls, True, None, torch.device("cpu")) == ["val_loss"]
    assert [name for name, *_ in replayed] == ["val_loss", "val_ok"]


def test_a_layer_returning_a_dict_is_named():
    from lightning_bfpp.layout.stage_module import StageModule

    class Encoder(torch.nn.Module):
        def forward(self, x):
            return {"hidden": x}

    stage = StageModule([("enc", Encoder()), ("head", torch.nn.Identity())], index=1, rank=1)
    with pytest.raises(TypeError, match=r"layer enc of stage 1 returned dict .* a tensor or a tuple of tensors"):
        stage(torch.zeros(2, 3))


class _Tracker:
    def __init__(self):
        self.total, self.n = 0.0, 0


def test_step_state_changes_are_carried_to_the_other_ranks():
    """What a step does to the module's plain attributes, replayed on a rank where it did not run."""
    from collections import defaultdict

    from lightning_bfpp.adapter import step_state

    def make():
        m = Classifier()
        m.outputs, m.count, m.by_loader, m.kept = [torch.tensor(0.0)], 3, defaultdict(list), {"a": [1]}
        m.per_loader, m.nested, m.stats = [[], []], {"val": {"loss": []}}, {"n": 0}
        m.tracker, m.total, m.fn = _Tracker(), torch.zeros(()), lambda x: x
        return m

    def step(m):
        m.outputs.append(torch.tensor(1.0))
        m.count += 1
        m.by_loader[1].append("x")
        m.kept["a"] = [7]  # replaced, not appended to
        m.new_attribute = "set"
        m.per_loader[1].append(2.0)  # inner lists of a list
        m.nested["val"]["loss"].append(3.0)
        m.stats["n"] += 4  # in place: numbers in a dict, a tracker object, a tensor
        m.tracker.total, m.tracker.n = 5.0, 1
        m.total += 6

    ran, other = make(), make()
    before = step_state.snapshot(ran)
    step(ran)
    found = step_state.changes(ran, before)
    assert {(c.attribute, c.kind) for c in found} == {
        ("outputs", "extend"), ("count", "set"), ("by_loader", "set_key"), ("kept", "set_key"),
        ("new_attribute", "set"), ("per_loader", "set"), ("nested", "set"), ("stats", "set"), ("tracker", "set"),
        ("total", "set")}
    step_state.apply(other, found)
    assert [float(t) for t in other.outputs] == [0.0, 1.0] and other.count == 4 and other.new_attribute == "set"
    assert other.by_loader == {1: ["x"]} and other.kept == {"a": [7]} and isinstance(other.by_loader, defaultdict)
    assert other.per_loader == [[], [2.0]] and other.nested == {"val": {"loss": [3.0]}} and other.stats == {"n": 4}
    assert (other.tracker.total, other.tracker.n, float(other.total)) == (5.0, 1, 6.0)
    assert step_state.changes(ran, step_state.snapshot(ran)) == []  # a step that changes nothing carries nothing


def test_empty_metric_list_states_match_the_last_stage():
    """A never-updated copy of a list-state metric (AUROC) gathers tensors of the last stage's dtype and rank."""
    from torchmetrics.classification import MulticlassAUROC

    from lightning_bfpp.adapter.steps import give_empty_list_states, list_state_kinds

    ran, other = Classifier(), Classifier()
    ran.auroc = MulticlassAUROC(4)
    other.auroc = MulticlassAUROC(4)
    ran.auroc.update(torch.randn(5, 4).softmax(-1), torch.randint(0, 4, (5,)))
    kinds = list_state_kinds(ran)
    assert kinds["auroc"] == {"preds": (torch.float32, (4,)), "target": (torch.int64, ())}
    give_empty_list_states(other, kinds, torch.device("cpu"))
    assert [(t.dtype, t.shape) for t in other.auroc.preds] == [(torch.float32, (0, 4))]
    assert [(t.dtype, t.shape) for t in other.auroc.target] == [(torch.int64, (0,))]
