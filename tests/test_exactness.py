"""Every layout and schedule reproduces plain single-process SGD training (same data order)."""

from __future__ import annotations

import math

import pytest
import torch
from exact_compare import assert_exact
from exact_model import reference, reference_eval
from launch import Launches, merged, run_slurm, run_torchrun

STEPS, BATCH = 3, 16

# (devices, config). Configs sharing a world size train one after another in one launch.
WORLD4 = [
    {"pp": 2, "loops": 2, "m": 2, "trace": True},
    {"pp": 2, "loops": 1, "m": 2},
    {"pp": 1, "loops": 1},
    {"pp": 1, "loops": 2},
    {"pp": 4, "loops": 1, "m": 4},
    {"pp": 4, "loops": 2, "m": 4},
    {"pp": 2, "loops": 2, "m": 2, "accumulate": 2},
    {"pp": 2, "loops": 2, "m": 2, "clip": 0.05},
    {"pp": 2, "loops": 1, "m": 4, "schedule": "gpipe"},
    {"pp": 2, "loops": 1, "m": 4, "schedule": "1f1b"},
    {"pp": 2, "loops": 2, "m": 4, "schedule": "depth_first", "trace": True},
    {"pp": 2, "loops": 2, "m": 4, "groups": 2, "trace": True},
    {"pp": 2, "loops": 2, "m": 2, "reshard": True, "trace": True},
    {"pp": 2, "loops": 2, "m": 2, "sharding": "none"},
    {"pp": 2, "loops": 2, "m": 2, "eval": True},
    {"pp": 2, "loops": 2, "m": 4, "batch": 32, "sharding": "full", "id": "act-full"},
    {"pp": 2, "loops": 2, "m": 4, "batch": 32, "sharding": "none", "id": "act-none"},
    # a weight tied across the first and the last stage (on different pipeline ranks, or one rank at pp=1)
    {"pp": 2, "loops": 2, "m": 2, "tied": True},
    {"pp": 2, "loops": 2, "m": 2, "tied": True, "clip": 0.05},
    {"pp": 2, "loops": 2, "m": 2, "tied": True, "opt": "adamw"},
    {"pp": 2, "loops": 2, "m": 2, "tied": True, "sharding": "none"},
    {"pp": 1, "loops": 2, "m": 2, "tied": True},
    # built on the meta device (trainer.init_module(empty_init=True)): each rank initializes its own stages only
    {"pp": 2, "loops": 2, "m": 2, "tied": True, "meta": True},
    # zero-bubble breadth-first (backward split into input- and weight-gradient passes): pp 4 and 2, loops 1 and 2,
    # dp 1 and 2 (with WORLD2)
    {"pp": 4, "loops": 2, "m": 4, "schedule": "breadth_first_zb"},
    {"pp": 4, "loops": 1, "m": 4, "schedule": "breadth_first_zb"},
    {"pp": 2, "loops": 2, "m": 2, "schedule": "breadth_first_zb", "tied": True, "clip": 0.05, "trace": True},
    # ignored targets (-100), the loss counting the others: the mean over the global batch's counted targets, over
    # data-parallel replicas, accumulated batches (with clipping), 1F1B and replicated weights
    {"pp": 2, "loops": 2, "m": 2, "counted": True},
    {"pp": 2, "loops": 2, "m": 2, "counted": True, "accumulate": 2, "clip": 0.05},
    {"pp": 2, "loops": 1, "m": 4, "schedule": "1f1b", "counted": True},
    {"pp": 2, "loops": 2, "m": 2, "counted": True, "sharding": "none", "tied": True},
    # cross-step overlap: the next step's first all-gathers start right after the optimizer step (FSDP over dp=2), a
    # validation in between (val_check_interval=2) and clipping
    {"pp": 2, "loops": 2, "m": 2, "cross_step": True, "eval": True, "clip": 0.05},
    # each layer its own FSDP unit (shard_unit="layer") under every schedule, with cross-step overlap, tied copies,
    # resharding after forward, groups with accumulation; its FSDP collectives traced per unit
    {"pp": 2, "loops": 2, "m": 2, "shard_unit": "layer", "cross_step": True, "tied": True, "clip": 0.05},
    {"pp": 2, "loops": 2, "m": 4, "shard_unit": "layer", "groups": 2, "accumulate": 2, "trace": True},
    {"pp": 2, "loops": 2, "m": 4, "shard_unit": "layer", "schedule": "depth_first"},
    {"pp": 2, "loops": 2, "m": 2, "shard_unit": "layer", "reshard": True, "trace": True},
    {"pp": 2, "loops": 1, "m": 4, "shard_unit": "layer", "schedule": "1f1b", "trace": True},
    {"pp": 2, "loops": 1, "m": 2, "shard_unit": "layer", "schedule": "gpipe", "eval": True},
    {"pp": 2, "loops": 2, "m": 2, "shard_unit": "layer", "schedule": "breadth_first_zb", "counted": True,
     "trace": True},
]
WORLD2 = [
    {"pp": 2, "loops": 1, "m": 2},
    {"pp": 2, "loops": 2, "m": 2, "timeline_trace": True},  # its last step as a Chrome trace (test_trace_*)
    {"pp": 1, "loops": 1, "m": 2},
    {"pp": 1, "loops": 2, "m": 2},
    {"pp": 2, "loops": 2, "m": 4, "schedule": "depth_first", "accumulate": 2, "clip": 0.05},
    {"pp": 2, "loops": 1, "m": 4, "schedule": "1f1b", "eval": True},
    {"pp": 2, "loops": 2, "m": 2, "tied": True},
    {"pp": 2, "loops": 2, "m": 2, "stage_layers": "auto"},  # cut by measured layer times (minimum over ranks)
    {"pp": 2, "loops": 2, "m": 1},  # looped breadth-first with fewer micro-batches than pipeline ranks (a bubble)
    {"pp": 2, "loops": 2, "m": 2, "counter": True, "eval": True},  # layers with state updated in forward
    {"pp": 2, "loops": 2, "m": 2, "counter": True, "ac": True},  # ... and recomputed in backward
    {"pp": 2, "loops": 2, "m": 2, "tied": True, "meta": True},  # built on the meta device, seeded per module
    {"pp": 1, "loops": 2, "m": 2, "tied": True, "meta": True},
    # layers built in configure_model, on the meta device, the head registered first (it initializes the tied weight)
    {"pp": 2, "loops": 2, "m": 2, "tied": True, "meta": "configure_model"},
    # zero-bubble breadth-first: activation checkpointing recomputes each layer in both backward passes
    {"pp": 2, "loops": 2, "m": 4, "schedule": "breadth_first_zb", "ac": True, "groups": 2},
    {"pp": 2, "loops": 1, "m": 2, "schedule": "breadth_first_zb", "sharding": "none"},
    # ignored targets, the loss counting the others: pp=2 x loops=2 x m=4, zero bubble, groups with accumulation,
    # data parallel alone
    {"pp": 2, "loops": 2, "m": 4, "counted": True},
    {"pp": 2, "loops": 2, "m": 4, "schedule": "breadth_first_zb", "counted": True},
    {"pp": 2, "loops": 2, "m": 4, "groups": 2, "counted": True, "accumulate": 2},
    {"pp": 1, "loops": 1, "m": 4, "counted": True},
    {"pp": 1, "loops": 2, "m": 4, "cross_step": True, "accumulate": 2},  # cross-step overlap, accumulating
]
# Same model and batch under each schedule, for saved-activation memory (checked for exactness too).
MEMORY = {
    "gpipe": {"pp": 2, "loops": 1, "m": 8, "schedule": "gpipe", "batch": 32},
    "1f1b": {"pp": 2, "loops": 1, "m": 8, "schedule": "1f1b", "batch": 32},
    "breadth_first": {"pp": 2, "loops": 2, "m": 8, "schedule": "breadth_first", "batch": 32},
    "depth_first": {"pp": 2, "loops": 2, "m": 8, "schedule": "depth_first", "batch": 32},
    "breadth_first_groups4": {"pp": 2, "loops": 2, "m": 8, "groups": 4, "batch": 32},
    "breadth_first_zb": {"pp": 2, "loops": 2, "m": 8, "schedule": "breadth_first_zb", "batch": 32},
}
WORLD2 += list(MEMORY.values())
WORLD1 = [{"pp": 1, "loops": 1}, {"pp": 1, "loops": 2, "m": 2}]


def _id(devices: int, cfg: dict) -> str:
    return f"w{devices}-" + "-".join(f"{k}{v}" for k, v in cfg.items() if k != "trace")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Launches:
    """Each world size's configs in one launch (Lightning's own launcher): `runs(devices)[index]`."""
    return Launches(tmp_path_factory, lambda devices, out: (devices, {1: WORLD1, 2: WORLD2, 4: WORLD4}[devices]))


def _check_against_reference(ranks: list[dict], cfg: dict, devices: int) -> None:
    pp = cfg.get("pp", 1)
    dp = devices // pp
    ref_params, ref_losses = reference(STEPS, cfg.get("batch", BATCH), dp, cfg.get("accumulate", 1), cfg.get("clip"),
                                       opt=cfg.get("opt", "sgd"), tied=cfg.get("tied", False),
                                       counter=cfg.get("counter", False), meta=cfg.get("meta", False),
                                       counted=cfg.get("counted", False))
    ref_params = {n: t for n, t in ref_params.items() if not n.startswith("counters.")}  # buffers: test_layer_state
    # each parameter lives on exactly one pipeline rank (rank = pp_index * dp + dp_index)
    owners: dict[str, set[int]] = {}
    for rank, r in enumerate(ranks):
        for name in r["params"]:
            owners.setdefault(name, set()).add(rank // dp)
    assert set(owners) == set(ref_params)
    assert all(len(o) == 1 for o in owners.values()), {n: o for n, o in owners.items() if len(o) > 1}
    assert_exact(merged(ranks), ref_params, "params")
    # train_loss: identical on every rank, equal to the reference's loss of the same batches
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]
    assert_exact(ranks[0]["losses"], ref_losses, "train_loss")
    # sharded across data parallel: local shard shapes add up to the full tensor, bytes split ~evenly
    sharded = cfg.get("sharding", "full") == "full" and dp > 1
    for rank, r in enumerate(ranks):
        for name, shape in r["local_shapes"].items():
            full = tuple(ref_params[name].shape)
            if sharded:
                # FSDP2 splits dim 0 into dp chunks of ceil(rows / dp) (the last ones may be short or empty)
                dp_index = rank % dp
                chunk = math.ceil(full[0] / dp)
                rows = min(max(full[0] - dp_index * chunk, 0), chunk)
                assert shape == (rows, *full[1:]), (name, shape, full)
            else:
                assert shape == full
    if sharded:
        for name in ref_params:
            rows = sum(r["local_shapes"][name][0] for r in ranks if name in r["local_shapes"])
            assert rows == ref_params[name].shape[0]


@pytest.mark.parametrize("devices,cfg", [(4, c) for c in WORLD4] + [(2, c) for c in WORLD2] + [(1, c) for c in WORLD1],
                         ids=lambda v: None)
def test_matches_single_process_reference(runs, devices, cfg):
    ranks = runs(devices)[({4: WORLD4, 2: WORLD2, 1: WORLD1}[devices]).index(cfg)]
    _check_against_reference(ranks, cfg, devices)


@pytest.mark.parametrize("devices,cfg", [(4, c) for c in WORLD4 if c.get("cross_step")]
                         + [(2, c) for c in WORLD2 if c.get("cross_step")], ids=lambda v: None)
def test_cross_step_overlap_gathers_the_next_steps_first_stages_early(runs, devices, cfg):
    """With cross_step_overlap the next step's first all-gathers started after the optimizer step, on every rank,
    before each optimizer step but the last (the end of the run settles them); the weights match one process
    (test_matches_single_process_reference)."""
    ranks = runs(devices)[({4: WORLD4, 2: WORLD2}[devices]).index(cfg)]
    assert [r["prefetches"] for r in ranks] == [STEPS] * devices


@pytest.mark.parametrize("cfg", [c for c in WORLD2 if c.get("counter")], ids=lambda c: "ac" if c.get("ac") else "plain")
def test_layer_state_is_updated_once_per_micro_batch_and_never_by_shape_inference(runs, cfg):
    """A layer's buffers updated in training-mode forwards (BatchNorm's running statistics, counters) see each
    micro-batch once, and nothing else: torch infers each stage's output shapes with one more forward (the real
    first micro-batch on the first stage, uninitialised tensors on the others), and activation checkpointing runs
    each forward again in backward; neither may leave a trace."""
    ranks = runs(2)[WORLD2.index(cfg)]
    state, _ = reference(STEPS, BATCH, 1, counter=True)
    buffers = merged(ranks, "buffers")  # each rank holds its own stages' layers
    assert {n for n in buffers if n.startswith("counters.")} == {
        f"counters.{i}.{b}" for i in range(2) for b in ("calls", "input_sum", "one")}
    for i in range(2):
        assert buffers[f"counters.{i}.calls"].item() == STEPS * cfg["m"]  # the whole batch, in m micro-batches
        # one micro-batch more or less, or a forward on uninitialised memory, moves this sum by ~1 or more
        assert_exact(buffers[f"counters.{i}.input_sum"], state[f"counters.{i}.input_sum"], f"counters.{i}.input_sum")


@pytest.mark.parametrize("devices", [4, 2])
def test_validate_test_predict_run_forward_only_pipelines(runs, devices):
    """val/test loss (identical on every rank) and predictions (on every rank) equal a plain forward of
    the same trained parameters (training itself is checked against the reference above)."""
    configs = {4: WORLD4, 2: WORLD2}[devices]
    index = next(i for i, c in enumerate(configs) if c.get("eval"))
    cfg = configs[index]
    ranks = runs(devices)[index]
    dp = devices // cfg["pp"]
    state = merged(ranks)
    val_ref, _ = reference_eval(state, dp, BATCH // dp, limit=2)
    test_ref, outputs_ref = reference_eval(state, dp, BATCH // dp)
    for rank, r in enumerate(ranks):
        assert_exact([r["val_loss"], r["test_loss"]], [val_ref, test_ref], f"rank {rank}'s val_loss, test_loss")
        if rank % dp == 0:  # data-parallel replica 0: every pipeline rank returns the last stage's outputs
            assert_exact(r["predictions"], outputs_ref, f"rank {rank}'s predictions")


def test_saved_activation_memory_follows_the_papers_ordering(runs):
    """Peak saved-activation bytes per rank: BF ~ GPipe >= DF ~ 1F1B; groups divide BF's peak; zero bubble holds
    what BF holds (each micro-batch's activations until its weight pass instead of its backward), not more."""
    peak = {}
    for name, cfg in MEMORY.items():
        ranks = runs(2)[WORLD2.index(cfg)]
        per_rank = ranks[0]["stats"]["memory"]  # every rank's numbers, the same on all ranks
        assert all(r["stats"]["memory"] == per_rank for r in ranks) and sorted(per_rank) == [0, 1]
        peak[name] = max(m["activation_peak_bytes"] for m in per_rank.values())
    print(peak)
    assert 0.8 <= peak["breadth_first"] / peak["gpipe"] <= 1.25
    assert 0.6 <= peak["depth_first"] / peak["1f1b"] <= 1.6
    assert peak["gpipe"] >= 2 * peak["1f1b"] and peak["breadth_first"] >= 2 * peak["depth_first"]
    assert 2.5 <= peak["breadth_first"] / peak["breadth_first_groups4"] <= 5
    assert 0.8 <= peak["breadth_first_zb"] / peak["breadth_first"] <= 1.05


def test_step_stats_hold_every_ranks_timeline(runs):
    """`step_stats["timeline"]`: each rank's own bubble, compute and step time, the same table on every rank; the
    top-level numbers are their max over ranks."""
    for cfg in MEMORY.values():
        ranks = runs(2)[WORLD2.index(cfg)]
        table = ranks[0]["stats"]["timeline"]
        assert all(r["stats"]["timeline"] == table for r in ranks) and sorted(table) == [0, 1]
        for key in ("bubble_fraction", "compute_s", "step_s"):
            assert ranks[0]["stats"][key] == max(t[key] for t in table.values()), key
        for t in table.values():
            assert 0 < t["compute_s"] <= t["step_s"]
            assert t["bubble_fraction"] == (t["step_s"] - t["compute_s"]) / t["compute_s"]


def test_trace_of_a_measured_step_is_trace_event_json_whose_busy_time_is_the_bubble(runs):
    """PipelineTrace on a 2-process run (pp=2 x loops=2): the last step's file is the Chrome trace event JSON that
    Perfetto opens (an object of complete "X" events and "M" names, microseconds), holding every rank's forward and
    backward passes and the sends, receives, all-gathers and reductions its runtime ran; from it, each rank's busy
    fraction (compute over the step) agrees with that step's ``step_stats`` bubble within 0.02, and the picture of
    the measured step beside the planned one is written."""
    import json
    from pathlib import Path

    from lightning_bfpp.runtime.chrome_trace import busy_fractions

    ranks = runs(2)[next(i for i, c in enumerate(WORLD2) if c.get("timeline_trace"))]
    (path,) = map(Path, ranks[0]["traces"])
    assert path.name == f"step{STEPS}.json" and path.with_suffix(".png").stat().st_size > 0
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms" and {e["ph"] for e in events} == {"X", "M"}
    for e in events:
        assert isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["ts"] >= 0 and e["dur"] >= 0, e
    kinds = {(e["pid"], e["cat"]) for e in events if e["ph"] == "X"}
    for rank in (0, 1):
        assert {(rank, k) for k in ("forward", "backward", "all-gather", "gradient reduction", "send activation",
                                    "receive activation", "send gradient", "receive gradient")} <= kinds
    busy = busy_fractions(trace)
    for rank, record in enumerate(ranks):
        bubble = record["stats"]["timeline"][rank]["bubble_fraction"]  # idle / busy over the same step
        assert abs(busy[rank] - 1 / (1 + bubble)) <= 0.02, (rank, busy[rank], bubble)


def test_activation_meter_does_not_count_fsdp_gathered_weights(runs):
    """Weights FSDP gathers and autograd saves (e.g. `weight.t()`) are parameters, not activations:
    the same activation bytes per rank with and without sharding."""
    full, none = (runs(4)[next(i for i, c in enumerate(WORLD4) if c.get("id") == key)]
                  for key in ("act-full", "act-none"))
    for rank in range(4):
        a = full[0]["stats"]["memory"][rank]["activation_peak_bytes"]
        b = none[0]["stats"]["memory"][rank]["activation_peak_bytes"]
        assert a == b > 0, (rank, a, b)


@pytest.mark.parametrize("index", [i for i, c in enumerate(WORLD4) if c.get("trace")])
def test_runtime_issues_fsdp_collectives_in_schedule_order(runs, index):
    """Instrumented FSDP all-gathers and reduce-scatters of step 2 (torch's own collective calls) follow
    the schedule's UNSHARD / REDUCE_GRAD actions, for each reshard policy, groups and depth-first."""
    cfg, ranks = WORLD4[index], runs(4)[index]
    for r in ranks:
        expected = [(op, s) for op, s in r["schedule_fsdp"] if op in ("UNSHARD", "REDUCE_GRAD")]
        if cfg.get("shard_unit") == "layer":  # each action: every unit of the stage, gathered in the layers' order
            assert all(r["units"][s] == r["stage_layers"][s] > 1 for s in r["units"]), (r["units"], r["stage_layers"])
            events = r["fsdp_trace"]
            for op, s in expected:
                done, events = events[:r["units"][s]], events[r["units"][s]:]
                units = [u for _, _, u in done]
                assert {(o, st) for o, st, _ in done} == {(op, s)}, (op, s, done)
                assert (units if op == "UNSHARD" else sorted(units)) == list(range(r["units"][s])), (op, s, units)
            assert not events
        else:
            assert r["fsdp_trace"] == expected
        gathers = sum(op == "UNSHARD" for op, _ in expected)
        if not (cfg.get("reshard") or cfg.get("groups", 1) > 1):  # each local stage gathered once per step
            assert gathers == cfg["loops"]
        else:  # more gathers, exactly as the schedule says (checked above)
            assert gathers > cfg["loops"]


@pytest.mark.parametrize("index", [i for i, c in enumerate(WORLD4) if c.get("trace") and c.get("shard_unit")])
def test_a_stage_sharded_per_layer_computes_its_first_layer_while_the_next_layers_arrive(runs, index):
    """shard_unit="layer": when a stage's first layer runs its first forward after the stage's UNSHARD, none of the
    stage's later units has been waited for (each unit's own FSDP hook waits for its gather when it runs)."""
    for r in runs(4)[index]:
        for s, units in r["units"].items():
            assert max(n for st, n in r["arriving"] if st == s) == units - 1 > 0, (s, units, r["arriving"])


def test_torchrun_launch(tmp_path):
    cfg = {"pp": 2, "loops": 2, "m": 2}
    ranks = run_torchrun(tmp_path, 2, [cfg])[0]
    assert {r["cluster_env"] for r in ranks} == {"TorchElasticEnvironment"}
    _check_against_reference(ranks, cfg, 2)


@pytest.mark.slow
def test_slurm_launch(tmp_path):
    cfg = {"pp": 2, "loops": 1, "m": 2}
    ranks = run_slurm(tmp_path, 2, [cfg])[0]
    assert {r["cluster_env"] for r in ranks} == {"SLURMEnvironment"}
    _check_against_reference(ranks, cfg, 2)


TIED = [(4, c) for c in WORLD4 if c.get("tied")] + [(2, c) for c in WORLD2 if c.get("tied")]


@pytest.mark.parametrize("devices,cfg", TIED, ids=lambda v: None)
def test_tied_copies_stay_bit_identical(runs, devices, cfg):
    """Each stage using the tied matrix holds a copy; after every step all copies are bit-identical."""
    ranks = runs(devices)[({4: WORLD4, 2: WORLD2}[devices]).index(cfg)]
    copies = [steps for r in ranks for steps in r["tied_history"].values()]
    assert len(copies) == devices * (2 if cfg["pp"] == 1 else 1)  # every rank holds one (pp=1: both)
    assert all(len(c) == STEPS for c in copies)
    for step in range(STEPS):
        assert all(torch.equal(c[step], copies[0][step]) for c in copies), step


def test_counted_configs_count_different_numbers_of_targets_per_micro_batch():
    """The counted configs test the loss rule only if micro-batches count different numbers of targets: with a mean
    per micro-batch, the reference's gradient would differ (checked here on the first batch of pp=2 x loops=2 x m=4)."""
    import torch.nn.functional as F
    from exact_model import StackNet, dataset, lightning_batches

    x, y = next(lightning_batches(BATCH, 1, dataset(ignored=True)))
    counts = [int((part != -100).sum()) for part in y.chunk(4)]
    assert len(set(counts)) > 1, counts
    torch.manual_seed(0)
    model = StackNet(counted=True)
    out = model(x)
    pooled = F.cross_entropy(out, y, ignore_index=-100)  # one process: every counted target weighs the same
    per_micro_batch = torch.stack([F.cross_entropy(o, t, ignore_index=-100) for o, t in zip(out.chunk(4), y.chunk(4))])
    assert abs(pooled.item() - per_micro_batch.mean().item()) > 1e-3
