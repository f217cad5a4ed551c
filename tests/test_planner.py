"""Planner: its pick beats every fixed schedule's best, respects memory, and prints train.py overrides."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_bfpp.schedule import SCHEDULES
from lightning_bfpp.sim import Cluster, Model
from lightning_bfpp.sim.bounds import memory_lower_bound
from lightning_bfpp.sim.planner import candidate_costs, candidates, search, simulate_candidate
from lightning_bfpp.sim.search_cache import order_memory_lower_bound

ROOT = Path(__file__).resolve().parents[1]


def _load(model: str, cluster: str, **override):
    m = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    c = yaml.safe_load((ROOT / "conf" / "cluster" / f"{cluster}.yaml").read_text())
    return Model.from_dict({**m, **override}), Cluster.from_dict(c)


BETAS = (0.125, 0.25, 0.5, 1, 2, 4, 8)  # sequences per GPU
SPACE = dict(loops=(1, 2, 3), max_micro_batches=4, max_groups=2)  # 2: pp=4 looped (10 layers)


def _fixed_best(model, cluster, batch, name):
    """Best fitting layout of one fixed schedule, enumerated here (not by the planner's candidates/pruning)."""
    from lightning_bfpp.schedule import ScheduleError, ScheduleSpec, build_schedule
    from lightning_bfpp.sim import build_costs, simulate
    from lightning_bfpp.sim.residency import relower

    div = lambda n: [d for d in range(1, n + 1) if n % d == 0]  # noqa: E731
    best = 0.0
    for tp in (1, 2, 4, 8):
        for pp in div(cluster.world_size // tp):
            dp = cluster.world_size // (pp * tp)
            if batch % dp or pp > model.num_layers:
                continue
            for mbs in div(batch // dp):
                m = batch // dp // mbs
                for loops in SPACE["loops"] if name in ("breadth_first", "depth_first") else (1,):
                    for groups in [g for g in (1, 2) if m % g == 0] if name == "breadth_first" else (1,):
                        # weights gathered for the step (with or without resharding after forward), an LRU cache
                        # of 1 .. loops-1 stages, regathered per run of computes; sharding none keeps them whole
                        fsdp = [("full", raf, "step", 0) for raf in (False, True)] + [("none", False, "step", 0)]
                        fsdp += [("full", False, "cache", k) for k in range(1, loops)] + [("full", False, "run", 0)]
                        for sharding, raf, residency, cache in fsdp:
                            if m > SPACE["max_micro_batches"] or pp * loops > model.num_layers:
                                continue
                            try:
                                sched = build_schedule(ScheduleSpec(name, pipeline_parallel=pp, loops=loops,
                                                                    micro_batches=m, groups=groups,
                                                                    reshard_after_forward=raf))
                            except ScheduleError:
                                continue
                            r = simulate(relower(sched, residency, cache),
                                         build_costs(model, cluster, pipeline_parallel=pp, loops=loops,
                                                     data_parallel=dp, micro_batch_size=mbs, micro_batches=m,
                                                     sharding=sharding, tensor_parallel=tp), timeline=False)
                            if r.peak_memory <= cluster.usable_memory:
                                best = max(best, r.tokens_per_second_per_device)
    return best


@pytest.mark.parametrize("nodes", [8, pytest.param(64, marks=pytest.mark.slow)])
def test_pick_never_worse_than_fixed_schedule(nodes):
    """At every batch per GPU, 64 and 512 GPUs: the planner's pick >= each fixed schedule's best layout found by
    an independent enumeration (the planner prunes families, lower-bounds memory and skips twins: none of
    that may lose the best); its plans fit capacity minus the reserve. A 10-layer cut of the 52B model.
    Fixed schedules include every weight residency (an unused one cannot make the planner look better)."""
    model, cluster = _load("gpt_52b", "a100_paper", n_layer=8)
    cluster = Cluster(**{**cluster.__dict__, "num_nodes": nodes})
    for beta in BETAS:
        batch = int(beta * cluster.world_size)
        plans = search(model, cluster, batch, top=1, shardings=("full", "none"), **SPACE)
        assert plans and plans[0].fits and plans[0].peak_memory <= cluster.usable_memory, beta
        for name in SCHEDULES:
            fixed = _fixed_best(model, cluster, batch, name)
            assert fixed > 0 or beta < 1, (nodes, beta, name)  # the enumeration finds layouts (not vacuous)
            assert plans[0].tokens_per_second_per_device >= fixed * (1 - 1e-9), (nodes, beta, name, plans[0], fixed)


def test_memory_filter_and_lower_bound():
    model, cluster = _load("gpt_small", "gpu_8")
    assert cluster.memory_reserve == 3e9  # a GPU cluster keeps a few GB for the CUDA context and comm buffers
    tight = Cluster(**{**cluster.__dict__, "device_memory": 4e7 + cluster.memory_reserve})
    plans = search(model, tight, 64, top=0, include_unfit=True, max_micro_batches=16)
    assert any(not p.fits for p in plans) and any(p.fits for p in plans)
    assert all(p.peak_memory <= 4e7 for p in plans if p.fits)
    assert any(p.peak_memory > 4e7 and p.peak_memory < tight.device_memory for p in plans)  # the reserve rejects these
    for c in list(candidates(model, cluster, 64, max_micro_batches=16))[::5]:
        assert (memory_lower_bound(c, candidate_costs(model, cluster, c))
                <= simulate_candidate(model, cluster, c).peak_memory)
    # a group pass keeps every local stage gathered: the bound counts them all, and reaches the simulated peak's weights
    c = next(c for c in candidates(model, cluster, 64, schedules=["breadth_first_zb"], loops=(4,), shardings=["full"],
                                   residencies=("step",)) if c.pipeline_parallel == 2 and not c.reshard_after_forward)
    costs, peak = candidate_costs(model, cluster, c), simulate_candidate(model, cluster, c).memory
    local = sum(st.weight_bytes * st.gathered_params for st in costs.stages[::2])
    assert max(m.category_peak["weights"] for m in peak) == pytest.approx(local)
    assert memory_lower_bound(c, costs) <= max(m.peak for m in peak)
    # accumulation groups: the last group's backward finds every local stage's unsharded gradient (counted, and still
    # below the simulated peak, for every breadth-first variant with groups)
    grouped = [c for c in candidates(model, cluster, 64, schedules=["breadth_first", "breadth_first_zb"], loops=(2, 4),
                                     shardings=["full"], max_micro_batches=16, max_groups=8) if c.groups > 1]
    assert len(grouped) > 20
    for c in grouped:
        costs = candidate_costs(model, cluster, c)
        assert memory_lower_bound(c, costs) <= simulate_candidate(model, cluster, c).peak_memory
    c = next(c for c in grouped if c.residency == "step")  # reduced once per step: the held gradients count
    costs = candidate_costs(model, cluster, c)
    no_grads = dataclasses.replace(costs, stages=[dataclasses.replace(st, grad_bytes=0) for st in costs.stages])
    assert memory_lower_bound(c, costs) > memory_lower_bound(c, no_grads)


def test_the_compute_orders_memory_bound_is_below_every_simulated_peak_and_sees_deferred_weight_passes():
    """``order_memory_lower_bound`` (activations and weight-pass inputs as the rank's compute order holds them) is no
    more than the simulated peak, for every schedule; under zero bubble with groups it sees what the layout-only bound
    cannot (its weight passes wait for idle time, so a group's activations outlive the group)."""
    model, cluster = _load("gpt_small", "gpu_8")
    every = list(candidates(model, cluster, 64, max_micro_batches=16, max_groups=8))
    assert {c.schedule for c in every} == set(SCHEDULES)
    for c in every[::3]:
        assert order_memory_lower_bound(model, cluster, c) <= simulate_candidate(model, cluster, c).peak_memory
    zb = [c for c in every if c.schedule == "breadth_first_zb" and c.groups > 1 and c.pipeline_parallel > 1]
    layout_only = [memory_lower_bound(c, candidate_costs(model, cluster, c)) for c in zb]
    assert zb and any(order_memory_lower_bound(model, cluster, c) > b for c, b in zip(zb, layout_only))


def test_overrides_format():
    model, cluster = _load("gpt_tiny", "cpu_2")
    plan = search(model, cluster, 8, top=1)[0]
    over = plan.candidate.overrides(cluster="cpu_2", batch_size=8)
    assert over[0] == f"schedule={plan.candidate.schedule}"
    assert f"schedule.pipeline_parallel={plan.candidate.pipeline_parallel}" in over
    assert any(o.startswith("schedule.reshard_after_forward=") and o.endswith(("true", "false")) for o in over)
    assert over[-2:] == ["cluster=cpu_2", "data.batch_size=8"]


def test_plan_cli_writes_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plan.py"), "model=gpt_tiny", "cluster=cpu_2", "data.batch_size=8",
         "plan.top=3"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "best layout for examples/train.py:" in proc.stdout and "cluster=cpu_2 data.batch_size=8" in proc.stdout
    (out,) = tmp_path.glob("outputs/plan/*/*/plan.json")  # its own run directory, nothing else in the cwd
    data = json.loads(out.read_text())
    assert data["plans"] and data["best_overrides"][0].startswith("schedule=")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"] and f"{out.relative_to(tmp_path)}" in proc.stdout


def test_plan_cli_searches_expert_parallel_for_a_mixture_of_experts(tmp_path):
    """model=gpt_moe_tiny with plan.expert_parallels=[2]: every row has ep=2, and the printed overrides carry it to
    examples/train.py."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plan.py"), "model=gpt_moe_tiny", "cluster=cpu_4",
         "data.batch_size=16", "plan.top=2", "plan.expert_parallels=[2]", "plan.expert_overlap=true", "plan.out=null"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "expert_parallel=2 " in proc.stdout and "schedule.expert_parallel=2 model=gpt_moe_tiny" in proc.stdout


def test_plan_cli_searches_expert_with_context_parallel(tmp_path):
    """plan.context_parallels=[2] beside plan.expert_parallels=[2] (a layout the runtime trains exactly,
    tests/test_experts.py "ep2-cp2"): the rows are ep=2 x cp=2, every one fully sharded (the runtime refuses expert
    parallel with replicated weights), and the printed overrides carry both sizes to examples/train.py."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plan.py"), "model=gpt_moe_tiny", "cluster=cpu_4",
         "data.batch_size=16", "plan.top=6", "plan.expert_parallels=[2]", "plan.context_parallels=[2]",
         "plan.out=null"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line[:4].strip().isdigit()]
    header = next(line.split() for line in proc.stdout.splitlines() if line.lstrip().startswith("# schedule"))[1:]
    assert rows and all(r[header.index("cp") + 1] == "2" and r[header.index("ep") + 1] == "2" for r in rows)
    assert {r[header.index("shard") + 1] for r in rows} == {"full"}
    assert "schedule.expert_parallel=2 schedule.context_parallel=2" in proc.stdout


def test_moe_reproduction_mixtral_on_64_gpus():
    """examples/moe_reproduction.py's first point (docs/mixture_of_experts.md): on 8 nodes the Mixtral-8x22B-like
    model's best breadth-first layout splits the experts over a node (ep=8), beats the Megatron-like baseline (which
    splits them too) with its overlap, and overlapping all-to-alls never makes a method slower."""
    from dataclasses import replace

    import moe_reproduction as figure

    model, cluster = figure.load("mixtral_8x22b", "a100_paper")
    cluster = replace(cluster, num_nodes=8)
    got = {(m, o): figure.best(model, cluster, m, o) for m in ("breadth_first", "megatron_like") for o in (False, True)}
    assert all(p is not None and p.fits for p in got.values()), got
    speed = {k: p.tokens_per_second_per_device for k, p in got.items()}
    assert got[("breadth_first", True)].candidate.expert_parallel == 8
    # the baseline trains expert parallel too (Megatron-Core's distributed optimizer with its experts split by ep):
    # bfpp's own rule against expert parallel with replicated weights does not bind it (it did: pp=32, ep=1, 0.5x)
    assert got[("megatron_like", True)].candidate.expert_parallel > 1, got[("megatron_like", True)]
    for method in ("breadth_first", "megatron_like"):
        assert speed[(method, True)] >= speed[(method, False)] * (1 - 1e-9), speed
    assert speed[("breadth_first", True)] > speed[("megatron_like", True)], speed


def test_residency_chosen_by_memory():
    """Depth-first on the 52B model without tensor parallel: with every local stage gathered the layout does
    not fit, so the planner keeps it by regathering (a cache or per run); with room to spare it keeps the
    weights for the step. Shorter residency is never faster than the step-long one in the same layout."""
    from dataclasses import replace

    model, cluster = _load("gpt_52b", "a100_paper", n_layer=16)
    cluster = replace(cluster, num_nodes=2)
    kw = dict(schedules=["depth_first"], shardings=["full"], tensor_parallels=(1,), loops=(4,), top=0,
              min_pipeline_parallel=4, max_pipeline_parallel=4, max_micro_batches=8)
    every = search(model, cluster, 32, include_unfit=True, **kw)
    by = {}
    for p in every:
        by.setdefault(p.candidate.micro_batches, {})[(p.candidate.residency, p.candidate.reshard_after_forward)] = p
    checked = 0
    for variants in by.values():
        step = variants[("step", False)]
        for key in (("cache", False), ("run", False)):
            if key in variants:
                assert variants[key].peak_memory < step.peak_memory
                assert variants[key].step_time >= step.step_time * (1 - 1e-9)
                checked += 1
    assert checked
    need = min(p.peak_memory for p in every if p.candidate.residency == "step")
    tight = replace(cluster, device_memory=need - 1.0 + cluster.memory_reserve)
    pick = search(model, tight, 32, **kw)[0]
    assert pick.candidate.residency != "step" and pick.peak_memory <= tight.usable_memory
    roomy = replace(cluster, device_memory=1e15)
    assert search(model, roomy, 32, **kw)[0].candidate.residency == "step"


def test_no_micro_batch_cap_and_exact_pruning():
    """Without a cap the micro-batch count reaches the replica's whole batch (one sample each), and the step-time
    lower bound the search prunes with never exceeds a simulated step."""
    from lightning_bfpp.sim.bounds import comm_lower_bound, step_time_lower_bound
    from lightning_bfpp.sim.planner import candidate_schedule

    model, cluster = _load("gpt_small", "gpu_8")
    cs = list(candidates(model, cluster, 256, loops=(1, 2), max_groups=1))
    assert max(c.micro_batches for c in cs) == 256  # pp = world: dp = 1, m = batch
    for c in cs[::7]:
        costs = candidate_costs(model, cluster, c)
        step = simulate_candidate(model, cluster, c).step_time
        assert step_time_lower_bound(c, costs) <= step * (1 + 1e-9)
        assert comm_lower_bound(candidate_schedule(c), costs) <= step * (1 + 1e-9)
    slow = dataclasses.replace(cluster, inter_bw=cluster.inter_bw / 100, num_nodes=2)  # gathers bound the step
    for c in list(candidates(model, slow, 64, loops=(1, 2, 4), max_groups=4, max_micro_batches=8))[::5]:
        costs, step = candidate_costs(model, slow, c), simulate_candidate(model, slow, c).step_time
        assert comm_lower_bound(candidate_schedule(c), costs) <= step * (1 + 1e-9), c


@pytest.mark.parametrize("top", [3, 8])
def test_first_top_plans_are_the_true_best(top):
    """The search skips candidates whose step-time bound cannot reach its `top`-th best so far: its first `top`
    plans equal the best `top` of the same list built without skipping (every candidate simulated; a family's
    slower memory-saving variants dropped once its fastest variant fits, as the search does)."""
    from lightning_bfpp.sim.planner import _family, _fastest_variant

    model, cluster = _load("gpt_small", "cpu_4")  # many near-equal layouts: pruning by the best alone lost some
    for batch in (8, 32):
        got = search(model, cluster, batch, top=top, **SPACE)[:top]
        everything = [p for p in search(model, cluster, batch, top=0, include_unfit=True, **SPACE) if p.fits]
        settled = {_family(p.candidate) for p in everything if _fastest_variant(p.candidate)}
        kept = [p for p in everything if _family(p.candidate) not in settled or _fastest_variant(p.candidate)]
        want = sorted((p.tokens_per_second_per_device for p in kept), reverse=True)[:top]
        assert len(kept) > 3 * top, len(kept)  # the search had something to skip
        assert [round(p.tokens_per_second_per_device, 6) for p in got] == [round(v, 6) for v in want], batch


@pytest.mark.parametrize("override, message", [
    ("data.batch_size=2.5", "data.batch_size=2.5 must be an integer >= 1"),
    ("plan.runtime_waits=bogus", "plan.runtime_waits='bogus' must be fsdp or cpu"),
    ("plan.schedules=[bogus]", "plan.schedules=['bogus'] must be a list of breadth_first"),
    ("plan.loops=[0]", "plan.loops=[0] must be a list of integers >= 1"),
    ("model.n_head=3", "model.n_embd=128 must be divisible by model.n_head=3"),
    ("plan.expert_parallels=[0]", "plan.expert_parallels=[0] must be a list of integers >= 1 or null"),
    ("plan.expert_overlap=maybe", "plan.expert_overlap='maybe' must be true or false"),
])
def test_plan_cli_names_a_setting_it_would_truncate_or_ignore(tmp_path, override, message):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "plan.py"), override, "plan.out=null"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and f"error: {message}" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_the_paper_model_plans_sequence_parallel_at_340_tokens_per_gpu():
    """Issue 32's bar: examples/plan.py model=gpt_52b cluster=a100_paper data.batch_size=64 (its default search
    space) picks a tp > 1 layout at >= 340 tokens/s/GPU, which needs sequence parallel: without it the best is lower."""
    plan = yaml.safe_load((ROOT / "conf" / "plan.yaml").read_text())["plan"]
    model, cluster = _load("gpt_52b", "a100_paper")
    space = dict(top=1, schedules=plan["schedules"], shardings=plan["shardings"], loops=plan["loops"],
                 max_groups=plan["max_groups"], residencies=("step",))
    best = search(model, cluster, 64, **space)[0]
    assert best.candidate.tensor_parallel > 1 and best.candidate.sequence_parallel, best
    assert best.tokens_per_second_per_device >= 340, best
    whole = search(model, cluster, 64, sequence_parallels=(False,), **space)[0]
    assert whole.tokens_per_second_per_device < 340 <= best.tokens_per_second_per_device, whole


def test_the_planner_searches_cross_step_overlap_where_the_host_time_between_steps_hides_a_gather():
    """A calibrated CPU cluster (host time between steps measured): with cross_step_overlaps=(False, True) the best
    sharded layout overlaps its first gather and the plan's command line says so; without host time it gains nothing
    here and the layouts are the ones found without searching it."""
    model, cluster = _load("gpt_tiny", "cpu_2_calibrated")
    plans = search(model, cluster, 8, top=3, shardings=["full"], cross_step_overlaps=(False, True))
    best = plans[0]
    assert best.candidate.cross_step_overlap and "schedule.cross_step_overlap=true" in best.candidate.overrides()
    without = next(p for p in plans if p.candidate == dataclasses.replace(best.candidate, cross_step_overlap=False))
    r = simulate_candidate(model, cluster, best.candidate)
    assert best.step_time == pytest.approx(r.step_time) and best.step_time < without.step_time
    free = dataclasses.replace(cluster, step_overhead=0.0)
    assert [p.candidate for p in search(model, free, 8, top=3, shardings=["full"], cross_step_overlaps=(False, True))] \
        == [p.candidate for p in search(model, free, 8, top=3, shardings=["full"])]


def test_the_planner_searches_per_layer_fsdp_units_and_says_so_on_the_command_line():
    """shard_units=("stage", "layer"): fully sharded candidates are also simulated with one FSDP unit per layer (none
    of the unsharded ones); where the stages' first gathers are exposed (the paper's 52B at pp 8 x loops 2: 8
    blocks per stage, each gathered in ~4 ms) that wins, by the simulation of the same candidate, and its overrides
    carry schedule.shard_unit=layer."""
    model, slow = _load("gpt_52b", "a100_paper")
    space = dict(top=0, include_unfit=True, schedules=["breadth_first"], loops=(2,), min_pipeline_parallel=8,
                 max_pipeline_parallel=8, tensor_parallels=(8,), sequence_parallels=(True,), residencies=("step",),
                 shardings=["full", "none"], shard_units=("stage", "layer"))
    plans = search(model, slow, 64, **space)
    assert not any(p.candidate.sharding == "none" and p.candidate.shard_unit == "layer" for p in plans)
    pairs = [(p, q) for p in plans for q in plans if p.candidate.shard_unit == "layer"
             and q.candidate == dataclasses.replace(p.candidate, shard_unit="stage")]
    assert pairs and all(p.step_time < q.step_time for p, q in pairs), [(p.step_time, q.step_time) for p, q in pairs]
    assert "schedule.shard_unit=layer" in pairs[0][0].candidate.overrides()
    r = simulate_candidate(model, slow, pairs[0][0].candidate)
    assert r.step_time == pytest.approx(pairs[0][0].step_time)


@pytest.mark.parametrize("model_name, cluster_name, batches", [
    ("gpt_small", "gpu_8", (8, 32)),
    ("gpt_tiny", "cpu_4", (8, 16)),
    ("gpt_tiny", "cpu_2_calibrated", (8,)),  # host time between steps: cross-step overlap gains
])
def test_pruned_search_keeps_the_exhaustive_answer(model_name, cluster_name, batches):
    """Every pruning (memory bounds before simulation, settled families, the step-time bound, shared stage costs)
    keeps the search's answer, the best fitting plan, as simulating every candidate finds it (or one tied with it),
    for each schedule alone and all together, cross-step overlap and per-layer FSDP units searched too."""
    model, cluster = _load(model_name, cluster_name)
    space = dict(loops=(1, 2, 4), max_micro_batches=8, max_groups=2, cross_step_overlaps=(False, True),
                 shard_units=("stage", "layer"))
    for batch in batches:
        for schedules in [[name] for name in SCHEDULES] + [list(SCHEDULES)]:
            pruned = search(model, cluster, batch, top=1, schedules=schedules, **space)
            every = search(model, cluster, batch, top=0, exhaustive=True, schedules=schedules, **space)
            assert len(every) > len(pruned), (batch, schedules)  # the search had something to skip
            ties = [p.candidate for p in every if p.tokens_per_second_per_device
                    == pytest.approx(every[0].tokens_per_second_per_device, rel=1e-12)]
            assert pruned[0].candidate in ties, (batch, schedules, pruned[0], every[0])
            assert pruned[0].tokens_per_second_per_device == every[0].tokens_per_second_per_device
