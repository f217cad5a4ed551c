"""Schedules as data: generation, legality, lowering, validation. No processes."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from lightning_bfpp.schedule import (
    SCHEDULES,
    Action,
    Op,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    build_schedule,
    check_spec,
    compute_order,
    lower,
    validate,
)


def _legal(spec: ScheduleSpec) -> bool:
    try:
        check_spec(spec)
        return True
    except ScheduleError:
        return False


def test_every_legal_combination_validates_and_illegal_ones_are_rejected():
    built = rejected = 0
    for name, pp, loops, m in itertools.product(SCHEDULES, range(1, 9), range(1, 5), range(1, 17)):
        spec = ScheduleSpec(name, pipeline_parallel=pp, loops=loops, micro_batches=m)
        looped_ok = name in ("breadth_first", "depth_first", "breadth_first_zb") or loops == 1
        # looped BF: any m (m < pp: bubble)
        expected = looped_ok and not (name == "depth_first" and loops > 1 and m % pp)
        assert _legal(spec) == expected, spec
        if not expected:
            rejected += 1
            continue
        sched = build_schedule(spec)  # validates
        for rank in range(pp):
            stages = sorted({a.stage for a in sched.compute_actions(rank)})
            assert stages == spec.local_stages(rank)
        built += 1
    # counted once by hand-checked rules above (+84: looped BF with m < pp; +512: breadth_first_zb, legal as BF is)
    assert built == 1534 and rejected == 1026


@pytest.mark.parametrize("variant", [{"reshard_after_forward": True}, {"forward_only": True}, {"groups": 2}])
def test_variants_validate_over_a_grid(variant):
    """Each variant builds and validates; every rank runs each local (stage, micro-batch) forward and backward
    once and reduces each local stage once (none of it when forward-only); resharding and groups gather more."""
    def gathers(sched: Schedule) -> int:
        return sum(a.op == Op.UNSHARD for actions in sched.actions.values() for a in actions)

    built = more_gathers = 0
    for pp, loops, m in itertools.product(range(1, 6), range(1, 4), range(2, 13, 2)):
        spec = ScheduleSpec("breadth_first", pipeline_parallel=pp, loops=loops, micro_batches=m, **variant)
        if not _legal(spec):
            continue
        sched, plain = build_schedule(spec), build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=pp,
                                                                           loops=loops, micro_batches=m))
        built += 1
        trained = 0 if spec.forward_only else 1
        for rank in range(pp):
            ops = Counter(a.op for a in sched.actions[rank])
            assert ((ops[Op.FORWARD], ops[Op.BACKWARD], ops[Op.REDUCE_GRAD])
                    == (loops * m, trained * loops * m, trained * loops))
        assert gathers(sched) >= gathers(plain)
        more_gathers += gathers(sched) > gathers(plain)
    assert built >= 70
    assert (more_gathers > 0) == (not spec.forward_only)


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        ({"name": "gpipe", "pipeline_parallel": 2, "loops": 2, "micro_batches": 4}, "loops=2"),
        ({"name": "1f1b", "pipeline_parallel": 2, "loops": 3, "micro_batches": 4}, "loops=3"),
        ({"name": "depth_first", "pipeline_parallel": 4, "loops": 2, "micro_batches": 6},
         "divisible by pipeline_parallel"),
        ({"name": "depth_first", "micro_batches": 4, "groups": 2}, "groups=2"),
        ({"name": "breadth_first", "micro_batches": 5, "groups": 2}, "divisible by groups"),
        ({"name": "zigzag"}, "schedule='zigzag'"),
        ({"name": "gpipe", "micro_batches": 0}, "micro_batches=0"),
    ],
)
def test_illegal_settings_name_the_setting(kwargs, setting):
    with pytest.raises(ScheduleError, match=setting.replace("(", r"\(")):
        check_spec(ScheduleSpec(**kwargs))


def test_breadth_first_golden_lowering():
    sched = build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=2))
    assert " ".join(map(str, sched.actions[0])) == (
        "0UNSHARD 2UNSHARD 0F0 0SEND_F0 2RECV_F0 0F1 0SEND_F1 2RECV_F1 2F0 2SEND_F0 2RECV_B0 2F1 2SEND_F1 2RECV_B1 "
        "2B0 2SEND_B0 0RECV_B0 2B1 2SEND_B1 2REDUCE_GRAD 2RESHARD 0RECV_B1 0B0 0B1 0REDUCE_GRAD 0RESHARD"
    )


def test_breadth_first_is_earliest_stage_first_depth_first_earliest_micro_batch_first():
    bf = compute_order(ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=4))[0]
    fwd = [(a.stage, a.micro_batch) for a in bf if a.op == Op.FORWARD]
    assert fwd == [(0, 0), (0, 1), (0, 2), (0, 3), (2, 0), (2, 1), (2, 2), (2, 3)]
    df = compute_order(ScheduleSpec("depth_first", pipeline_parallel=2, loops=2, micro_batches=4))[0]
    fwd = [(a.stage, a.micro_batch) for a in df if a.op == Op.FORWARD]
    assert fwd == [(0, 0), (0, 1), (2, 0), (2, 1), (0, 2), (0, 3), (2, 2), (2, 3)]


def _fsdp(sched: Schedule, rank: int, op: Op) -> list[int]:
    return [a.stage for a in sched.actions[rank] if a.op == op]


def test_breadth_first_fsdp_points_follow_the_paper():
    spec = ScheduleSpec("breadth_first", pipeline_parallel=2, loops=3, micro_batches=4)
    sched = build_schedule(spec)
    for rank in range(2):
        acts = sched.actions[rank]
        stages = spec.local_stages(rank)
        assert sorted(_fsdp(sched, rank, Op.UNSHARD)) == stages  # gathered once per step
        for s, nxt in zip(stages, stages[1:]):  # prefetch: next stage's gather issued before s computes
            first_compute = next(i for i, a in enumerate(acts) if a.stage == s and a.is_compute)
            assert acts.index(Action(nxt, Op.UNSHARD)) < first_compute
        for s in stages:  # reduce right after the stage's last backward
            last_b = max(i for i, a in enumerate(acts) if a.stage == s and a.op == Op.BACKWARD)
            following = [a for a in acts[last_b + 1:] if a.op not in (Op.SEND_B, Op.RECV_B, Op.RECV_F)]
            assert following[0] == Action(s, Op.REDUCE_GRAD)


def test_reshard_after_forward_and_groups_multiply_gathers():
    base = ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=4)
    keep = build_schedule(base)
    reshard = build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=4,
                                          reshard_after_forward=True))
    groups = build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=4, groups=2))
    for rank in range(2):
        first, last = base.local_stages(rank)
        assert len(_fsdp(keep, rank, Op.UNSHARD)) == 2
        # the last local stage turns from forward to backward with nothing in between: stays gathered
        assert _fsdp(reshard, rank, Op.UNSHARD).count(first) == 2 and _fsdp(reshard, rank, Op.UNSHARD).count(last) == 1
        # each group gathers again, except the first stage whose backward of group 0 runs straight into
        # its forward of group 1 (kept gathered)
        assert _fsdp(groups, rank, Op.UNSHARD).count(first) == 1 and _fsdp(groups, rank, Op.UNSHARD).count(last) == 2
        assert len(_fsdp(groups, rank, Op.REDUCE_GRAD)) == 2  # gradients reduced once, after the last group


def _swap(sched: Schedule, rank: int, a: Action, b: Action) -> Schedule:
    acts = list(sched.actions[rank])
    i, j = acts.index(a), acts.index(b)
    acts[i], acts[j] = acts[j], acts[i]
    return Schedule(sched.spec, {**sched.actions, rank: acts})


def test_validator_catches_misordered_receives_deadlocks_and_missing_gathers():
    sched = build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=2))
    with pytest.raises(ScheduleError, match="sender's order"):
        validate(_swap(sched, 1, Action(1, Op.RECV_F, 0), Action(1, Op.RECV_F, 1)))
    with pytest.raises(ScheduleError, match="deadlocks"):  # rank 1 waits for stage-2 output before sending stage 1's
        validate(_swap(sched, 1, Action(1, Op.FORWARD, 0), Action(3, Op.FORWARD, 0)))
    no_gather = Schedule(sched.spec, {r: [a for a in acts if a != Action(0, Op.UNSHARD)]
                                      for r, acts in sched.actions.items()})
    with pytest.raises(ScheduleError, match="without gathered weights"):
        validate(no_gather)
    no_reduce = Schedule(sched.spec, {r: [a for a in acts if a.op != Op.REDUCE_GRAD]
                                      for r, acts in sched.actions.items()})
    with pytest.raises(ScheduleError, match="never runs REDUCE_GRAD"):
        validate(no_reduce)


def _edit(sched: Schedule, rank: int, edit) -> Schedule:
    return Schedule(sched.spec, {**sched.actions, rank: edit(list(sched.actions[rank]))})


def test_validator_names_each_broken_rule():
    sched = build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=2))
    acts = sched.actions[0]
    f00, send = acts.index(Action(0, Op.FORWARD, 0)), acts.index(Action(0, Op.SEND_F, 0))
    reduce = acts.index(Action(2, Op.REDUCE_GRAD))
    cases = {
        "runs 0F0 twice": lambda a: a[: f00 + 1] + [a[f00]] + a[f00 + 1:],
        "sends 0SEND_F0 before computing it": lambda a: a[:f00] + [a[send]] + [x for x in a[f00:] if x != a[send]],
        "reduces gradients of stage 2 after": lambda a: [a[reduce]] + a[:reduce] + a[reduce + 1:],
        "unshards stage 0 twice": lambda a: [Action(0, Op.UNSHARD)] + a,
        "stage 1 lives on rank 1": lambda a: [Action(1, Op.FORWARD, 0)] + a,
    }
    for message, edit in cases.items():
        with pytest.raises(ScheduleError, match=message):
            validate(_edit(sched, 0, edit))


def test_lowered_lists_pair_every_send_with_a_receive():
    spec = ScheduleSpec("depth_first", pipeline_parallel=4, loops=2, micro_batches=8)
    acts = lower(spec, compute_order(spec))
    sends = sum(a.op in (Op.SEND_F, Op.SEND_B) for r in acts.values() for a in r)
    recvs = sum(a.op in (Op.RECV_F, Op.RECV_B) for r in acts.values() for a in r)
    assert sends == recvs == 2 * 8 * (spec.num_stages - 1)


def test_breadth_first_zb_splits_each_backward_and_fills_half_the_bubble():
    """Zero-bubble breadth-first: every backward is an input-gradient pass I and, later on the same rank, a
    weight-gradient pass W; a stage's gradients are reduced after its last W. With unit costs (F = 1, B = 2 split
    into I = W = 1) at pp=4, loops=2, m=8 its simulated bubble is below half of breadth-first's, at the same
    activation peak."""
    from lightning_bfpp.sim import evaluate, unit_costs

    for pp, loops, m, groups in itertools.product((1, 2, 4), (1, 2, 3), (1, 4, 8), (1, 2)):
        spec = ScheduleSpec("breadth_first_zb", pipeline_parallel=pp, loops=loops, micro_batches=m, groups=groups)
        if m % groups:
            continue
        for rank, actions in build_schedule(spec).actions.items():
            ops = Counter(a.op for a in actions)
            assert ops[Op.BACKWARD] == 0 and ops[Op.BACKWARD_INPUT] == ops[Op.BACKWARD_WEIGHT] == loops * m
            position = {(a.op, a.stage, a.micro_batch): i for i, a in enumerate(actions)}
            for s in spec.local_stages(rank):
                assert all(position[(Op.BACKWARD_INPUT, s, k)] < position[(Op.BACKWARD_WEIGHT, s, k)] for k in range(m))
                assert position[(Op.REDUCE_GRAD, s, None)] > max(position[(Op.BACKWARD_WEIGHT, s, k)] for k in range(m))
    results = {}
    for name in ("breadth_first", "breadth_first_zb"):
        spec = ScheduleSpec(name, pipeline_parallel=4, loops=2, micro_batches=8)
        results[name] = evaluate(build_schedule(spec), unit_costs(spec.num_stages, 4))
    bf, zb = results["breadth_first"], results["breadth_first_zb"]
    assert zb.pipeline_bubble < 0.5 * bf.pipeline_bubble, (zb.pipeline_bubble, bf.pipeline_bubble)
    # 48 units of work per rank; zb: only the 3-tick pipeline fill idles
    assert (bf.step_time, zb.step_time) == (57, 51)
    peak = lambda r: max(x.category_peak["activations"] for x in r.memory)  # noqa: E731
    assert peak(zb) == peak(bf)


def test_breadth_first_zb_groups_divide_its_activation_memory():
    """Under zero bubble a W pass holds its micro-batch's activations, so a group's W passes end on each rank before
    that rank's first forward of the next group (else groups would divide nothing: W passes wait for idle time, which
    a long breadth-first pass hardly has); the activation peak (unit costs) then falls with the number of groups."""
    from lightning_bfpp.sim import evaluate, unit_costs

    for pp, loops, m, groups in itertools.product((1, 2, 4), (1, 2, 3), (4, 8), (2, 4)):
        spec = ScheduleSpec("breadth_first_zb", pipeline_parallel=pp, loops=loops, micro_batches=m, groups=groups)
        per_group = m // groups
        for actions in build_schedule(spec).actions.values():
            group = [a.micro_batch // per_group if a.micro_batch is not None else None for a in actions]
            for g in range(1, groups):
                first_forward = next(i for i, a in enumerate(actions) if a.op == Op.FORWARD and group[i] == g)
                last_weight = max(i for i, a in enumerate(actions) if a.op == Op.BACKWARD_WEIGHT and group[i] == g - 1)
                assert last_weight < first_forward, (spec, g)
    peak = {}
    for groups in (1, 2, 4):
        spec = ScheduleSpec("breadth_first_zb", pipeline_parallel=4, loops=2, micro_batches=8, groups=groups)
        r = evaluate(build_schedule(spec), unit_costs(spec.num_stages, 4))
        peak[groups] = max(x.category_peak["activations"] for x in r.memory)
    assert peak[4] < peak[2] < peak[1], peak


def test_breadth_first_zb_loses_nothing_to_the_first_stages_unsplit_backward():
    """torch's first stage has no input-gradient pass to split off (its input needs no gradient): its I does nothing
    and its W the whole backward. The order still idles only for the pipeline's fill, 3·L·m + pp − 1 unit ticks, at
    every layout with m >= pp (an order played with I = W = 1 there took 27 ticks at pp=2, loops=2, m=4; 55 at pp=4,
    loops=2, m=8)."""
    from lightning_bfpp.sim import simulate, unit_costs

    for pp, loops, m in itertools.product((2, 3, 4), (1, 2, 4), (4, 8)):
        if m < pp:
            continue
        spec = ScheduleSpec("breadth_first_zb", pipeline_parallel=pp, loops=loops, micro_batches=m)
        costs = unit_costs(spec.num_stages, pp)
        assert costs.stages[0].weight_fraction == 1.0 and costs.stages[1].weight_fraction == 0.5
        assert simulate(build_schedule(spec), costs).step_time == 3 * loops * m + pp - 1, (pp, loops, m)


def test_validator_rejects_a_weight_pass_before_its_input_pass():
    sched = build_schedule(ScheduleSpec("breadth_first_zb", pipeline_parallel=2, loops=2, micro_batches=2))
    i, w = Action(0, Op.BACKWARD_INPUT, 1), Action(0, Op.BACKWARD_WEIGHT, 1)
    with pytest.raises(ScheduleError, match=r"0W1 waits for its input-gradient pass 0I1"):
        validate(_swap(sched, 0, i, w))
    early_reduce = _edit(sched, 0, lambda a: [x for x in a if x != Action(0, Op.REDUCE_GRAD)][:-2] +
                         [Action(0, Op.REDUCE_GRAD)] + [x for x in a if x != Action(0, Op.REDUCE_GRAD)][-2:])
    with pytest.raises(ScheduleError, match=r"reduces gradients of stage 0 after 1/2 backwards"):
        validate(early_reduce)
