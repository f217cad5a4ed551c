"""Calibration file format: lightning_bfpp.sim.calibration.summarize -> cluster yaml -> simulator (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

from lightning_bfpp.schedule import ScheduleSpec, build_schedule  # noqa: E402
from lightning_bfpp.sim import Cluster, Model, build_costs, simulate  # noqa: E402

MODEL = yaml.safe_load((ROOT / "conf" / "model" / "gpt_small.yaml").read_text())


def _samples(t: float, n: int = 5, noisy: float | None = None) -> list[tuple[float, float]]:
    """n clean samples of t seconds, plus (optionally) noisy ones that waited most of their time."""
    out = [(t, 0.0)] * n
    if noisy is not None:
        out += [(noisy, 0.9 * noisy)] * (n + 2)
    return out


def _raw(world: int = 2) -> list[dict]:
    rank = {
        "layers": {
            "embedding": {"forward": _samples(1e-4), "backward": _samples(2e-4)},
            "block": {"forward": _samples(0.01, noisy=0.05), "backward": _samples(0.02)},
            "head": {"forward": _samples(1e-3), "backward": _samples(2e-3)},
        },
        "block_solo": {"forward": _samples(0.009), "backward": _samples(0.018)},
        "grad_scale": _samples(3e-10),
        "overhead": _samples(2e-4),
        "pipeline": {"durations": [3e-4] * 9, "gaps": [1e-4] * 9, "delays": [2e-4] * 9, "ends": [1e-3] * 9,
                     "params": [1.0]},
        "pipeline_block": {"durations": [0.03] * 9, "gaps": [4e-4] * 9, "delays": [2e-3] * 9, "ends": [3e-3] * 9,
                           "params": [1e6]},
        "comm": {"ping_pong_small": _samples(2e-4), "ping_pong_big": _samples(2e-4 + 2 * 1e6 / 2e9),
                 "all_gather": _samples(1e-4 + 1e6 / 1e9), "reduce_scatter": _samples(1e-4 + 1e6 / 5e8)},
    }
    return [rank] * world


def test_summary_round_trips_through_yaml_into_the_simulator(tmp_path):
    from lightning_bfpp.sim.calibration import load_cluster, save_cluster, summarize

    summary = summarize(_raw(), MODEL, micro_batch_size=4, threads=1, nbytes=1_000_000, max_wait=0.03)
    c = summary["cluster"]
    assert c["layer_times"]["block"] == [0.01, 0.02]  # noisy samples (waited 90%) were dropped
    assert c["backward_factor"] == pytest.approx(2.0)
    assert c["compute_overhead"] == pytest.approx(7e-4)  # inside a ~zero-FLOP action + host gap around blocks
    assert c["step_overhead"] == pytest.approx(3e-3 - 3e-10 * 1e6)  # step ends minus the gradient scaling
    message = 4 * 4 * MODEL["block_size"] * MODEL["n_embd"]
    assert c["p2p_latency"] == pytest.approx(2e-3 - 4e-4 - message / c["intra_node_bandwidth"], rel=1e-3)
    assert c["latency"] == pytest.approx(1e-4)
    assert c["intra_node_bandwidth"] == pytest.approx(2e9, rel=1e-3)
    assert c["collective_bandwidth"] == pytest.approx(5e8, rel=1e-3)  # the slower of all-gather, reduce-scatter
    base = yaml.safe_load((ROOT / "conf" / "cluster" / "cpu_2.yaml").read_text())
    path = tmp_path / "cal.yaml"
    save_cluster(path, {**base, **c}, command="calibrate --test", processes=2, threads=1,
                 clean_samples=summary["info"]["clean_samples"])
    assert path.read_text().startswith("# Calibrated by `calibrate --test` on ")
    assert load_cluster(path) == {**base, **c}
    cluster = Cluster.from_dict(load_cluster(path))
    assert cluster.layer_times is not None and cluster.layer_times.block == (0.01, 0.02)
    assert cluster.overhead == pytest.approx(7e-4) and cluster.collective_bw == pytest.approx(5e8, rel=1e-3)
    assert cluster.step_overhead == pytest.approx(c["step_overhead"]) and cluster.p2p_latency == c["p2p_latency"]

    model = Model.from_dict(MODEL)
    costs = build_costs(model, cluster, pipeline_parallel=2, loops=1, data_parallel=1, micro_batch_size=4,
                        micro_batches=4, activation_bytes=4)
    # 2 stages of [embedding + 4 blocks] and [4 blocks + head]: measured seconds, not FLOPs
    assert costs.stages[0].forward == pytest.approx(1e-4 + 4 * 0.01 + 7e-4)
    assert costs.stages[1].backward == pytest.approx(4 * 0.02 + 2e-3 + 7e-4)
    assert costs.stages[0].reduce_host == pytest.approx(cluster.grad_scale * costs.stages[0].params)
    assert costs.step_overhead == pytest.approx(c["step_overhead"])
    assert costs.p2p_time(0, 1) == pytest.approx(cluster.p2p_latency + message / cluster.intra_bw)
    # twice the micro-batch: linear in the samples
    double = build_costs(model, cluster, pipeline_parallel=2, loops=1, data_parallel=1, micro_batch_size=8,
                         micro_batches=4)
    assert double.stages[0].forward - 7e-4 == pytest.approx(2 * (costs.stages[0].forward - 7e-4))


def test_layer_times_only_apply_to_a_model_of_their_shape():
    cfg = yaml.safe_load((ROOT / "conf" / "cluster" / "cpu_2.yaml").read_text())
    cfg["layer_times"] = {"model": {"n_head": 8, "n_embd": 256, "block_size": 128, "vocab_size": 256},
                          "micro_batch_size": 4, "embedding": [1.0, 1.0], "block": [1.0, 1.0], "head": [1.0, 1.0]}
    cluster = Cluster.from_dict(cfg)
    wider = Model.from_dict({**MODEL, "n_embd": 512})
    assert wider.layer_times(cluster, 4) is None  # falls back to FLOPs / achieved_flops
    costs = build_costs(wider, cluster, pipeline_parallel=2, loops=1, data_parallel=1, micro_batch_size=4,
                        micro_batches=4)
    flops = sum(wider.layer_forward_flops()[:5]) * 4 * MODEL["block_size"] / cluster.flops
    assert costs.stages[0].forward == pytest.approx(flops + cluster.overhead)
    assert costs.stages[0].backward == pytest.approx(cluster.backward_factor * flops + cluster.overhead)


def test_step_overhead_adds_once_per_step():
    cfg = yaml.safe_load((ROOT / "conf" / "cluster" / "cpu_2.yaml").read_text())
    model = Model.from_dict(MODEL)
    kwargs = dict(pipeline_parallel=2, loops=2, data_parallel=1, micro_batch_size=4, micro_batches=4)
    sched = build_schedule(ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=4))
    plain = simulate(sched, build_costs(model, Cluster.from_dict(cfg), **kwargs)).step_time
    more = simulate(sched, build_costs(model, Cluster.from_dict({**cfg, "step_overhead": 0.01}), **kwargs)).step_time
    assert more - plain == pytest.approx(0.01)


def test_gradient_scaling_is_host_time_at_reduce_grad():
    cfg = yaml.safe_load((ROOT / "conf" / "cluster" / "cpu_2.yaml").read_text())
    model = Model.from_dict(MODEL)
    kwargs = dict(pipeline_parallel=2, loops=1, data_parallel=1, micro_batch_size=4, micro_batches=4)
    plain = build_costs(model, Cluster.from_dict(cfg), **kwargs)
    scaled = build_costs(model, Cluster.from_dict({**cfg, "grad_scale_time_per_param": 1e-8}), **kwargs)
    sched = build_schedule(ScheduleSpec("gpipe", pipeline_parallel=2, loops=1, micro_batches=4))
    extra = simulate(sched, scaled).step_time - simulate(sched, plain).step_time
    # rank 0 scales its stage's gradients after its last backward, the last action of the step
    assert extra == pytest.approx(1e-8 * scaled.stages[0].params, rel=1e-6)


def test_checked_in_calibration_loads():
    path = ROOT / "conf" / "cluster" / "cpu_2_calibrated.yaml"
    if not path.exists():
        pytest.skip("no calibration written yet (python examples/calibrate.py --out ...)")
    cluster = Cluster.from_dict(yaml.safe_load(path.read_text()))
    model = Model.from_dict(MODEL)
    times = model.layer_times(cluster, 4)  # None unless measured on this model's shape
    assert times is not None and len(times) == model.n_layer + 2, times  # embedding, the blocks, head
    assert all(forward > 0 and backward > 0 for forward, backward in times), times
