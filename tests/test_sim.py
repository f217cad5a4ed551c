"""Simulator: closed-form bubbles, the model's comm/compute pieces, memory ordering of the schedules."""
import dataclasses
import itertools

import pytest
import torch
from gpt import GPT, GPTConfig
from torch.distributed.pipelining._backward import stage_backward_input

from lightning_bfpp import mean_loss
from lightning_bfpp.layout.auto import measure_layers
from lightning_bfpp.schedule import ScheduleError, ScheduleSpec, build_schedule
from lightning_bfpp.sim import (
    MEGATRON,
    Cluster,
    Model,
    SimOptions,
    WireBytes,
    build_costs,
    evaluate,
    ring_time,
    simulate,
    unit_costs,
)

GRID = [
    (name, pp, loops, m)
    for name in ("gpipe", "1f1b", "depth_first", "breadth_first")
    for pp, loops, m in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2, 4, 6, 8, 12))
    if loops == 1 or name in ("depth_first", "breadth_first")
]


def _legal(spec):
    try:
        return build_schedule(spec)
    except ScheduleError:
        return None


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "depth_first", "breadth_first"])
def test_bubble_closed_form(name):
    """Free comm, uniform stages: bubble = (pp-1)/(loops*m) exactly, also with F:B = 1:2 or 1:1."""
    checked = 0
    for n, pp, loops, m in GRID:
        if n != name or (sched := _legal(ScheduleSpec(n, pipeline_parallel=pp, loops=loops, micro_batches=m))) is None:
            continue
        if n == "breadth_first" and loops > 1 and m < pp:
            continue  # a different closed form: test_looped_breadth_first_with_fewer_micro_batches_than_stages_per_loop
        for backward in (1.0, 2.0):
            r = simulate(sched, unit_costs(pp * loops, pp, backward=backward))
            assert r.bubble == pytest.approx((pp - 1) / (loops * m), abs=1e-12), (n, pp, loops, m)
            assert r.step_time == pytest.approx((1 + backward) * (loops * m + (pp - 1)), abs=1e-9)
        checked += 1
    assert checked >= 12


def test_bubble_breadth_first_groups():
    """Each group is one breadth-first pass: the bubble is paid once per group."""
    pp, loops, m, g = 2, 2, 8, 2
    r = simulate(build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=pp, loops=loops, micro_batches=m,
                                             groups=g)), unit_costs(pp * loops, pp))
    assert r.bubble == pytest.approx(g * (pp - 1) / (loops * m))


def test_prefetch_hides_all_gather_and_reduce_overlaps():
    """BF: only the first all-gather and the last reduce are exposed when comm is cheaper than a stage."""
    spec = ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=4)
    r = evaluate(build_schedule(spec), unit_costs(4, 2, unshard=0.5, reduce=0.5))
    assert r.exposed_comm == pytest.approx(1.0)
    blocking = evaluate(build_schedule(spec), unit_costs(4, 2, unshard=0.5, reduce=0.5),
                        SimOptions(blocking_reduce=True))
    assert blocking.step_time > r.step_time


def test_cross_step_overlap_hides_the_first_gather_behind_the_host_time_between_steps():
    """With the next step's first all-gathers started right after the optimizer step, the step is shorter by the host
    time between steps that is not already hidden behind the first rank's last reduction (0.5 here: the gather cannot
    start before it), at most the first rank's wait for its first gather (0.5)."""
    spec = ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=4)
    sched = build_schedule(spec)
    for overhead, gain in ((0.2, 0.0), (0.7, 0.2), (3.0, 0.5), (0.0, 0.0)):
        costs = dataclasses.replace(unit_costs(4, 2, unshard=0.5, reduce=0.5), step_overhead=overhead)
        plain, overlapped = simulate(sched, costs), simulate(sched, costs, SimOptions(cross_step_overlap=True))
        assert plain.cross_step_gain == pytest.approx(gain) and overlapped.step_time == pytest.approx(
            plain.step_time - gain)
        assert overlapped.peak_memory == plain.peak_memory
    unsharded = dataclasses.replace(unit_costs(4, 2, sharding="none"), step_overhead=1.0)
    assert simulate(sched, unsharded).cross_step_gain == 0.0  # nothing to gather


def test_a_stage_sharded_per_layer_computes_each_layer_once_its_own_weights_arrived():
    """shard_unit="layer" (two equal units per stage): a stage's first forward starts once its first layer's weights
    arrived, and each layer waits for its own; the exposed first gather halves (0.5 -> 0.25), the step with it."""
    spec = ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=4)
    sched = build_schedule(spec)
    whole = unit_costs(4, 2, unshard=0.5, reduce=0.5)
    layered = dataclasses.replace(whole, stages=[dataclasses.replace(st, unit_gather=(0.25, 0.25),
                                                                     unit_share=(0.5, 0.5)) for st in whole.stages])
    one, per_layer = evaluate(sched, whole), evaluate(sched, layered)
    first = lambda r: next(e for e in r.rank_timeline(0) if e.kind == "F")  # noqa: E731
    assert (first(one).start, first(one).end) == pytest.approx((0.5, 1.5))
    assert (first(per_layer).start, first(per_layer).end) == pytest.approx((0.25, 1.25))
    assert per_layer.step_time == pytest.approx(one.step_time - 0.25)
    assert per_layer.exposed_comm == pytest.approx(one.exposed_comm - 0.25)
    # gather-bound (4 s of weights, 1 s of forward): the second layer waits for its weights (arrived at 4)
    slow = dataclasses.replace(layered, stages=[dataclasses.replace(st, unshard=4.0, unit_gather=(2.0, 2.0))
                                                for st in layered.stages])
    assert (first(evaluate(sched, slow)).start, first(evaluate(sched, slow)).end) == pytest.approx((2.0, 4.5))


def test_megatron_like_waits_for_reduction_at_end():
    spec = ScheduleSpec("depth_first", pipeline_parallel=2, loops=2, micro_batches=4)
    costs = unit_costs(4, 2, reduce=0.5, p2p=0.1, sharding="none")
    fsdp_like = simulate(build_schedule(spec), costs)
    megatron = simulate(build_schedule(spec), costs, MEGATRON)
    assert megatron.step_time >= fsdp_like.step_time + 0.5  # at least the last stage's reduction
    for rank in range(2):  # each rank reduces over its dp group after its own pipeline flush
        events = megatron.rank_timeline(rank)
        last_compute = max(e.end for e in events if e.kind in "FB")
        reduces = [e for e in events if e.kind == "REDUCE"]
        assert len(reduces) == 2 and min(e.start for e in reduces) >= last_compute - 1e-9


def test_timeline_matches_action_lists():
    sched = build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=4,
                                        reshard_after_forward=True))
    r = simulate(sched, unit_costs(4, 2, unshard=0.2, reduce=0.2))
    for rank in range(2):
        compute = [(e.stage, e.kind, e.micro_batch) for e in r.rank_timeline(rank) if e.kind in "FB"]
        assert compute == [(a.stage, a.op.value, a.micro_batch) for a in sched.compute_actions(rank)]
        unshards = [e for e in r.rank_timeline(rank) if e.kind == "UNSHARD"]
        assert len(unshards) == sum(a.op.value == "UNSHARD" for a in sched.actions[rank])


def test_cost_model_pieces():
    assert ring_time(8.0, 1, 1.0, 1.0) == 0.0
    assert ring_time(8.0, 4, 2.0, 0.0) == pytest.approx(3.0)
    model = Model(n_layer=4, n_head=4, n_embd=64, seq=32, vocab=256)
    cluster = Cluster(devices=4, num_nodes=2, flops=1e12, device_memory=1e10, intra_bw=1e11, inter_bw=1e9, latency=0.0)
    intra = build_costs(model, cluster, pipeline_parallel=2, loops=1, data_parallel=4, micro_batch_size=2,
                        micro_batches=4)
    inter = build_costs(model, cluster, pipeline_parallel=1, loops=1, data_parallel=8, micro_batch_size=2,
                        micro_batches=4)
    assert intra.stages[0].unshard == pytest.approx(3 / 4 * 2 * intra.stages[0].params / 1e11)
    assert inter.stages[0].unshard == pytest.approx(7 / 8 * 2 * inter.stages[0].params / 1e9)
    assert intra.p2p[(0, 1)] == pytest.approx(2 * 2 * 32 * 64 / 1e9)  # pipeline neighbours on two nodes
    st = intra.stages[0]
    assert st.backward == pytest.approx(2 * st.forward)
    assert sum(s.params for s in intra.stages) == sum(model.layer_params())
    none = build_costs(model, cluster, pipeline_parallel=2, loops=1, data_parallel=4, micro_batch_size=2,
                       micro_batches=4, sharding="none")
    assert none.stages[0].unshard == 0 and none.stages[0].reduce == pytest.approx(2 * intra.stages[0].reduce)


def test_wire_bytes_follow_the_runs_precision():
    """FSDP moves what the run holds: a 32-true run gathers and reduces fp32 (twice the bf16 regime's time and
    gathered-weight bytes), bf16-mixed gathers bf16 and reduces fp32 (parallel.stage_mixed_precision)."""
    model = Model(n_layer=4, n_head=4, n_embd=64, seq=32, vocab=256)
    cluster = Cluster(devices=4, num_nodes=1, flops=1e12, device_memory=1e10, intra_bw=1e11, inter_bw=1e9, latency=0.0)

    def costs(precision=None):
        layers = model.layers(cluster)
        if precision:
            layers = dataclasses.replace(layers, wire=WireBytes.for_precision(precision))
        return build_costs(layers, cluster, pipeline_parallel=2, loops=1, data_parallel=2, micro_batch_size=2,
                           micro_batches=4)

    bf16, fp32, mixed = costs(), costs("32-true"), costs("bf16-mixed")
    assert costs("bf16-true").stages[0] == bf16.stages[0]  # the default is the paper's bf16 regime
    for st16, st32, stm in zip(bf16.stages, fp32.stages, mixed.stages):
        assert (st32.unshard, st32.reduce) == pytest.approx((2 * st16.unshard, 2 * st16.reduce))
        assert (stm.unshard, stm.reduce) == pytest.approx((st16.unshard, 2 * st16.reduce))
    assert fp32.p2p[(0, 1)] == pytest.approx(2 * bf16.p2p[(0, 1)])  # fp32 messages (latency 0)
    sched = build_schedule(ScheduleSpec("gpipe", pipeline_parallel=2, micro_batches=4))
    peaks = [simulate(sched, c).memory[0].category_peak for c in (bf16, fp32)]
    assert peaks[1]["weights"] == pytest.approx(2 * peaks[0]["weights"])
    assert peaks[1]["gradients"] == pytest.approx(2 * peaks[0]["gradients"])


def _activation_peak(name, loops, groups=1, pp=4, m=16):
    model = Model(n_layer=16, n_head=8, n_embd=512, seq=256, vocab=256)
    cluster = Cluster(devices=8, num_nodes=1, flops=1e13, device_memory=8e10, intra_bw=1e11, inter_bw=1e10,
                      latency=1e-5)
    costs = build_costs(model, cluster, pipeline_parallel=pp, loops=loops, data_parallel=2, micro_batch_size=1,
                        micro_batches=m)
    r = simulate(build_schedule(ScheduleSpec(name, pipeline_parallel=pp, loops=loops, micro_batches=m,
                                             groups=groups)), costs)
    return max(mem.activations for mem in r.memory)


def test_memory_ordering():
    """BF keeps all micro-batches alive like GPipe; DF and 1F1B about pp of them; groups divide BF's."""
    gpipe, bf = _activation_peak("gpipe", 1), _activation_peak("breadth_first", 2)
    one_f_one_b, df = _activation_peak("1f1b", 1), _activation_peak("depth_first", 2)
    assert bf == pytest.approx(gpipe, rel=0.05)
    assert df == pytest.approx(one_f_one_b, rel=0.5)
    assert bf > 2.5 * df
    for groups in (2, 4):
        assert _activation_peak("breadth_first", 2, groups) == pytest.approx(bf / groups, rel=0.05)


def test_sharding_divides_state_by_dp():
    model = Model(n_layer=4, n_head=4, n_embd=64, seq=32, vocab=256)
    cluster = Cluster(devices=8, num_nodes=1, flops=1e12, device_memory=1e10, intra_bw=1e11, inter_bw=1e9, latency=0.0)
    sched = build_schedule(ScheduleSpec("1f1b", pipeline_parallel=2, loops=1, micro_batches=4))
    static = {}
    for sharding in ("full", "none"):
        costs = build_costs(model, cluster, pipeline_parallel=2, loops=1, data_parallel=4, micro_batch_size=1,
                            micro_batches=4, sharding=sharding)
        static[sharding] = simulate(sched, costs).memory[0].static
    assert static["none"] == pytest.approx(static["full"] * 4 * 20 / 16)


def test_stuck_action_lists_raise():
    from lightning_bfpp.schedule import Action, Op, Schedule

    spec = ScheduleSpec("gpipe", pipeline_parallel=2, loops=1, micro_batches=1)
    actions = {  # rank 0 runs its backward before the forward that rank 1's gradient depends on
        0: [Action(0, Op.UNSHARD), Action(0, Op.RECV_B, 0), Action(0, Op.BACKWARD, 0), Action(0, Op.FORWARD, 0),
            Action(0, Op.SEND_F, 0), Action(0, Op.RESHARD)],
        1: [Action(1, Op.RECV_F, 0), Action(1, Op.UNSHARD), Action(1, Op.FORWARD, 0), Action(1, Op.BACKWARD, 0),
            Action(1, Op.SEND_B, 0), Action(1, Op.RESHARD)],
    }
    with pytest.raises(ScheduleError, match="cannot progress"):
        simulate(Schedule(spec, actions), unit_costs(2, 2))


def test_tensor_parallel_divides_compute_state_and_adds_in_node_collectives():
    """tp: per-rank FLOPs and split params / tp, 2+2 all-reduces per block on the in-node links, and with
    sequence parallel every block activation / tp (Korthikanti et al.)."""
    model = Model(n_layer=4, n_head=8, n_embd=256, seq=64, vocab=512)
    cluster = Cluster(devices=8, num_nodes=2, flops=1e12, device_memory=1e10, intra_bw=1e11, inter_bw=1e9, latency=0.0)
    one = build_costs(model, cluster, pipeline_parallel=2, loops=1, data_parallel=8, micro_batch_size=2,
                      micro_batches=4)
    tp4 = build_costs(model, cluster, pipeline_parallel=2, loops=1, data_parallel=2, micro_batch_size=2,
                      micro_batches=4, tensor_parallel=4)
    assert tp4.tensor_parallel == 4 and sum(s.params for s in tp4.stages) < 0.3 * sum(s.params for s in one.stages)
    h, s, b, t = 256, 64, 2, 4
    block_tp = 2 * (2 * (t - 1) / t * 2 * s * h * b / 1e11)  # two all-reduces of the bf16 activation
    block_compute = (2 * 12 * h * h + 4 * s * h) / t * s * b / 1e12
    layers = model.layers(cluster, 4)
    assert layers.forward_flops[1] * 4 == model.layer_forward_flops()[1]
    mid = build_costs(model.layers(cluster, 4), cluster, pipeline_parallel=6, loops=1, data_parallel=1,
                      micro_batch_size=2, micro_batches=1, tensor_parallel=4, stage_layers=[1, 1, 1, 1, 1, 1])
    assert mid.stages[1].forward == pytest.approx(block_compute + block_tp)
    assert mid.stages[1].backward == pytest.approx(2 * block_compute + block_tp)
    # the dp group of a tp=4 layout is 4 ranks apart: dp=2 x tp=4 fills a node, so the FSDP traffic stays in it
    assert not tp4.stages[0].inter_node and tp4.p2p_inter == frozenset({(0, 1), (1, 0)})
    sp = model.layers(cluster, 4, sequence_parallel=True).activation_bytes[1]
    assert sp == pytest.approx(model.layer_activation_bytes(1)[1] / 4)
    assert model.layers(cluster, 4).activation_bytes[1] > sp
    with pytest.raises(ValueError, match="tensor_parallel=3"):
        model.layers(cluster, 3)


def test_network_interface_is_shared_and_link_end_is_the_latest():
    """An inter-node pipeline message crossing the interface during an all-gather delays that all-gather."""
    spec = ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=2)
    quiet = unit_costs(4, 2, unshard=3.0, p2p=0.5)
    shared = unit_costs(4, 2, unshard=3.0, p2p=0.5)
    shared.stages = [type(st)(**{**st.__dict__, "inter_node": True}) for st in shared.stages]
    shared.p2p_inter = frozenset(shared.p2p)
    a, b = simulate(build_schedule(spec), quiet), simulate(build_schedule(spec), shared)
    assert b.step_time > a.step_time
    # rank 1 sends to rank 0 both ways round (pp=2: one link each way); the step waits for its last message
    r = simulate(build_schedule(ScheduleSpec("gpipe", pipeline_parallel=2, micro_batches=2)), unit_costs(2, 2, p2p=5.0))
    assert r.step_time >= max(e.end for e in r.timeline if e.kind.startswith("SEND"))


def test_optimizer_sharding_is_megatron_distributed_optimizer():
    model = Model(n_layer=4, n_head=4, n_embd=64, seq=32, vocab=256)
    cluster = Cluster(devices=8, num_nodes=1, flops=1e12, device_memory=1e10, intra_bw=1e11, inter_bw=1e9, latency=0.0)
    sched = build_schedule(ScheduleSpec("1f1b", pipeline_parallel=2, loops=1, micro_batches=4))
    kw = dict(pipeline_parallel=2, loops=1, data_parallel=4, micro_batch_size=1, micro_batches=4)
    opt = build_costs(model, cluster, sharding="optimizer", **kw)
    static = simulate(sched, opt).memory[0].static
    assert static == pytest.approx((6 + 12 / 4) * sum(opt.stages[s].params for s in (0,)))
    p = opt.stages[0].params  # fp32 reduce-scatter + bf16 all-gather of the updated parameters
    assert opt.stages[0].reduce == pytest.approx(ring_time(4 * p, 4, 1e11, 0) + ring_time(2 * p, 4, 1e11, 0))


def test_looped_breadth_first_with_fewer_micro_batches_than_stages_per_loop():
    """Legal with a bubble: each group's first micro-batch crosses all loops*pp stages, the other k-1 follow
    (k = m/groups <= pp): step = groups * (loops*pp + k - 1) * (F + B)."""
    for pp, loops, m, groups in [(2, 2, 1, 1), (4, 2, 2, 1), (4, 3, 4, 2), (8, 8, 4, 1), (4, 2, 8, 8)]:
        spec = ScheduleSpec("breadth_first", pipeline_parallel=pp, loops=loops, micro_batches=m, groups=groups)
        r = simulate(build_schedule(spec), unit_costs(pp * loops, pp))
        assert r.step_time == pytest.approx(3 * groups * (loops * pp + m // groups - 1)), spec


def _gathered_and_reduced(sched):
    """Independent check of a relowered schedule: every compute runs on gathered weights, frees pair with
    gathers, nothing stays gathered, and no stage runs a backward after its last gradient reduction."""
    from lightning_bfpp.schedule import Op

    gathers = {}
    for rank, actions in sched.actions.items():
        gathered, last_reduce, last_backward, n = set(), {}, {}, 0
        for i, a in enumerate(actions):
            if a.op is Op.UNSHARD:
                assert a.stage not in gathered
                gathered.add(a.stage)
                n += 1
            elif a.op is Op.RESHARD:
                gathered.remove(a.stage)
            elif a.op is Op.REDUCE_GRAD:
                last_reduce[a.stage] = i
            elif a.is_compute:
                assert a.stage in gathered, (rank, i, a)
                if a.op is Op.BACKWARD:
                    last_backward[a.stage] = i
        assert not gathered
        assert all(last_reduce.get(s, -1) > i for s, i in last_backward.items()), rank
        gathers[rank] = n
    return gathers


@pytest.mark.parametrize("name,loops", [("depth_first", 3), ("breadth_first", 3), ("1f1b", 1), ("gpipe", 1)])
def test_residency_relowering(name, loops):
    """Residency re-places only FSDP actions. Breadth-first's "run" residency regathers each stage once for its
    backward run (2*loops - 1 gathers: the last local stage's forward and backward runs touch), while
    depth-first's regathers for every micro-batch run: the paper's depth-first network overhead."""
    from lightning_bfpp.sim.residency import relower

    pp, m = 2, 4
    sched = build_schedule(ScheduleSpec(name, pipeline_parallel=pp, loops=loops, micro_batches=m))
    base = {r: [a for a in acts if not a.op.name.endswith(("SHARD", "GRAD"))] for r, acts in sched.actions.items()}
    counts = {}
    for residency, cache in (("step", 0), ("cache", 2), ("cache", 1), ("run", 0)):
        re = relower(sched, residency, cache)
        assert {r: [a for a in acts if not a.op.name.endswith(("SHARD", "GRAD"))]
                for r, acts in re.actions.items()} == base
        counts[(residency, cache)] = _gathered_and_reduced(re)
    for r in range(pp):
        assert counts[("step", 0)][r] == loops  # the schedule's own lowering: each local stage gathered once
        assert counts[("step", 0)][r] <= counts[("cache", 2)][r] <= counts[("cache", 1)][r] <= counts[("run", 0)][r]
        if name == "breadth_first":
            assert counts[("run", 0)][r] == 2 * loops - 1
        if name == "depth_first":
            assert counts[("run", 0)][r] >= 2 * m * loops // pp > 2 * loops - 1


def test_residency_trades_memory_for_gathers():
    """Unit stages, all-gathers and reduce-scatters as long as a forward and backward: a short residency frees gathered
    weights and unsharded gradients (peak category bytes fall) and pays one all-gather per regather on the gather stream
    (the step lasts at least gathers x all-gather time)."""
    from lightning_bfpp.sim.residency import relower

    pp, loops, m, params = 2, 4, 4, 10
    sched = build_schedule(ScheduleSpec("depth_first", pipeline_parallel=pp, loops=loops, micro_batches=m))
    costs = unit_costs(pp * loops, pp, unshard=3.0, reduce=3.0, params=params, activation=0.0)
    res = {k: simulate(relower(sched, k, 2), costs) for k in ("step", "cache", "run")}
    gathers = {k: _gathered_and_reduced(relower(sched, k, 2)) for k in res}
    weights = {k: max(m_.category_peak["weights"] for m_ in r.memory) for k, r in res.items()}
    grads = {k: max(m_.category_peak["gradients"] for m_ in r.memory) for k, r in res.items()}
    assert weights["step"] == 2 * params * loops  # every local stage gathered at once
    assert weights["run"] <= 2 * params * 2 < weights["step"]  # the computing stage and the prefetched next
    assert grads["run"] < grads["step"] == 2 * params * loops
    for k, r in res.items():
        assert r.step_time >= max(gathers[k].values()) * 3.0
    assert res["step"].step_time < res["cache"].step_time <= res["run"].step_time


def test_sequence_parallel_sends_each_ranks_shard():
    """With sequence parallel the stage-boundary activation is split over tp: each tp rank sends 1/tp of it."""
    model = Model(8, 16, 1024, 512, 1024)
    cluster = Cluster(devices=8, num_nodes=4, flops=1e14, device_memory=8e10, intra_bw=3e11, inter_bw=2.5e10,
                      latency=1e-5)
    kw = dict(pipeline_parallel=4, loops=1, data_parallel=1, micro_batch_size=2, micro_batches=4, tensor_parallel=8)
    whole, split = (build_costs(model, cluster, sequence_parallel=sp, **kw) for sp in (False, True))
    message = 2 * 2 * 512 * 1024  # bf16 x micro-batch x seq x width
    # tp=8, dp=1: pipeline neighbours in other nodes
    assert whole.p2p_time(0, 1) == pytest.approx(1e-5 + message / 2.5e10)
    assert split.p2p_time(0, 1) == pytest.approx(1e-5 + message / 8 / 2.5e10)


def test_bandwidth_hurts_megatron_reduction_fully_and_overlapped_fsdp_partly():
    """Same layout (52B cut to 16 layers, 128 GPUs, pp 4 x tp 8 + SP, 4 loops, 4 micro-batches, dp 4), inter-node
    bandwidth halved: Megatron-like's end-of-step reduction is not overlapped, so its step grows by at least its
    reduction's growth; BF's FSDP all-gathers and reduce-scatters run under compute, so its step grows by less
    than half of theirs while they fit under it."""
    from dataclasses import replace

    model = Model(14, 64, 8192, 1024, 51200)
    cluster = Cluster(devices=8, num_nodes=16, flops=156e12, device_memory=8e10, intra_bw=3e11, inter_bw=5e10,
                      latency=1e-5, intra_latency=1e-6)
    pp, loops, m, tp, dp = 4, 4, 4, 8, 4
    bf = build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=pp, loops=loops, micro_batches=m))
    df = build_schedule(ScheduleSpec("depth_first", pipeline_parallel=pp, loops=loops, micro_batches=m))
    kw = dict(pipeline_parallel=pp, loops=loops, data_parallel=dp, micro_batch_size=1, micro_batches=m,
              tensor_parallel=tp, sequence_parallel=True)

    def run(bw):
        cl = replace(cluster, inter_bw=bw)
        fsdp, dist_opt = (build_costs(model, cl, sharding="full", **kw),
                          build_costs(model, cl, sharding="optimizer", **kw))
        local = lambda r: range(r, pp * loops, pp)  # noqa: E731
        comm = max(sum(fsdp.stages[s].unshard + fsdp.stages[s].reduce for s in local(r)) for r in range(pp))
        reduce = max(sum(dist_opt.stages[s].reduce for s in local(r)) for r in range(pp))
        return simulate(bf, fsdp).step_time, simulate(df, dist_opt, MEGATRON).step_time, comm, reduce

    bf_fast, mg_fast, comm_fast, reduce_fast = run(50e9)
    bf_slow, mg_slow, comm_slow, reduce_slow = run(25e9)
    assert reduce_slow - reduce_fast > 0.01  # the reduction is a visible part of the step
    assert mg_slow - mg_fast >= (reduce_slow - reduce_fast) * (1 - 1e-9)
    assert bf_slow - bf_fast < 0.5 * (comm_slow - comm_fast)
    assert mg_slow / bf_slow > mg_fast / bf_fast  # so BF's lead grows as bandwidth falls (on one layout)


def _kept_for_weight_pass(stage, params, x, upstream=None) -> int:
    """Bytes torch's split backward keeps from `stage`'s input-gradient pass for its weight pass (`params`)."""
    y = stage(x)
    _, groups = stage_backward_input([y], None if upstream is None else [upstream(y)], [x], iter(params))
    return sum(g.numel() * g.element_size() for group in groups for grads in group.get("grads") or [] for g in grads
               if g is not None and isinstance(g, torch.Tensor))


def test_weight_pass_bytes_are_what_torchs_split_backward_keeps():
    """What zero bubble holds from a micro-batch's input-gradient pass to its weight pass, per layer: the analytic
    transformer (Model, bf16: half of this fp32 run) and a measured model's (layout.auto.measure_layers) are the bytes
    torch's stage_backward_input keeps, for examples/gpt.py's block and head."""
    b, cfg = 3, GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    layers = list(gpt.pipeline_layers())
    block, head = layers[1], layers[-1]
    x = torch.randn(b, cfg.block_size, cfg.n_embd, requires_grad=True)
    target = torch.randint(0, cfg.vocab_size, (b, cfg.block_size))
    kept_block = _kept_for_weight_pass(block, block.parameters(), x, torch.randn_like)
    kept_head = _kept_for_weight_pass(lambda z: mean_loss(gpt.pipeline_loss(head(z), target)),  # its loss
                                      head.parameters(), x)
    assert kept_block == 11 * b * cfg.block_size * cfg.n_embd * 4  # q, k, v, proj, fc (4h), fc2, two norms
    analytic = Model(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size).layer_weight_grad_bytes(b)
    assert [2 * a for a in analytic[1:]] == [kept_block, kept_block, kept_head]
    ids = torch.randint(0, cfg.vocab_size, (b, cfg.block_size))
    measured = measure_layers(gpt, layers, ids, target, torch.device("cpu"), repeats=1).weight_grad_bytes
    assert [m * b for m in measured[1:]] == [kept_block, kept_block, kept_head]


def test_zero_bubble_holds_what_its_weight_passes_wait_for():
    """breadth_first_zb keeps each stage's weight-pass bytes from its input pass to its weight pass: the last stage
    its layers', the first stage (no input pass: its input needs no gradient) the gradient it received; breadth-first
    keeps none."""
    model = Model(4, 4, 64, 32, 256)
    cluster = Cluster(devices=2, num_nodes=1, flops=1e10, device_memory=1e12, intra_bw=1e9, inter_bw=1e9, latency=1e-5)
    costs = build_costs(model, cluster, pipeline_parallel=2, loops=1, data_parallel=1, micro_batch_size=2,
                        micro_batches=1, sharding="none", stage_layers=[3, 3])
    layers = model.layers(cluster)
    last = sum(layers.weight_grad_bytes[3:]) * 2
    first = 2 * 32 * 64 * 2  # the gradient of its output: a message, bf16
    assert [s.weight_pass_bytes for s in costs.stages] == [first, last]
    peaks = {name: [m.category_peak["weight_pass"] for m in simulate(build_schedule(ScheduleSpec(
        name, pipeline_parallel=2, micro_batches=1)), costs).memory] for name in ("breadth_first", "breadth_first_zb")}
    assert peaks == {"breadth_first": [0.0, 0.0], "breadth_first_zb": [first, last]}
