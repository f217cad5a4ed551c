"""The calibrated-cluster format.

A measuring run (examples/calibrate.py: `devices` gloo processes timing the example GPT's layers, the pipelining
runtime and gloo's collectives) produces, per process, lists of ``(seconds, run-queue wait seconds)`` samples;
``summarize`` turns them into these cluster keys (seconds, bytes/s, FLOP/s), which ``save_cluster`` writes over a
base cluster yaml and ``sim.Cluster.from_dict`` reads:

- ``achieved_flops``, ``backward_factor``: one block's forward FLOPs / forward seconds, backward / forward;
- ``compute_overhead``: seconds inside a ~zero-FLOP forward/backward action plus the host gap after one;
- ``grad_scale_time_per_param``: the 1/m gradient scaling at REDUCE_GRAD, per parameter;
- ``step_overhead``: per step and rank, before the first and after the last action;
- ``intra_node_bandwidth`` / ``inter_node_bandwidth`` (p2p), ``collective_bandwidth`` (ring model, the slower of
  all-gather and reduce-scatter), ``latency`` (one-way small message), ``p2p_latency`` (a pipeline message as
  the runtime sees it);
- ``layer_times``: ``model`` (its ``SHAPE_KEYS``), ``micro_batch_size``, ``threads``, ``processes`` and
  ``[forward, backward]`` seconds of ``embedding``, ``block`` and ``head`` (+ loss) for one micro-batch.

Pure Python (+ PyYAML): the noise-robust estimate, the fit from raw samples to the cluster keys, and writing and
reading the yaml.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import yaml

SHAPE_KEYS = ("n_head", "n_embd", "block_size", "vocab_size")  # what per-layer times depend on (not n_layer)


def robust(samples: list[tuple[float, float]], max_wait: float) -> tuple[float, int]:
    """Median of the samples that waited at most `max_wait` of their time (clean); with fewer than 3 clean
    ones, the lower quartile of all. Returns (seconds, number of clean samples)."""
    clean = [t for t, w in samples if w <= max_wait * t]
    if len(clean) >= 3:
        return statistics.median(clean), len(clean)
    times = sorted(t for t, _ in samples)
    return times[len(times) // 4], len(clean)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _links(comm: dict, world: int, nbytes: int, max_wait: float) -> dict[str, float]:
    """Gloo's links from the ping-pong and collective samples: one-way latency, p2p bandwidth, ring bandwidths."""
    lat = robust(comm["ping_pong_small"], max_wait)[0] / 2  # one way
    p2p = robust(comm["ping_pong_big"], max_wait)[0] / 2
    ring, full = {}, world * nbytes  # each rank's nbytes, gathered (or reduce-scattered from) world * nbytes
    for key in ("all_gather", "reduce_scatter"):
        s = robust(comm[key], max_wait)[0]
        # ring_time(full, world, bw, lat) = (w-1)/w * full / bw + (w-1) * lat  ->  solve for bw
        ring[key] = (world - 1) / world * full / max(s - (world - 1) * lat, 1e-9)
    return {"latency": lat, "p2p_s": p2p, "p2p_bw": nbytes / max(p2p - lat, 1e-9), "ring": ring}


def _runtime(pipe: dict, real: dict, grad_scale: float, links: dict, message: float) -> dict[str, float]:
    """The pipelining runtime's own costs from its timed actions (``pipe``: ~zero-FLOP stages, ``real``: blocks)."""
    in_action = _median(pipe["durations"])  # a ~zero-FLOP action: all of it is the runtime's bookkeeping
    gap, delay = _median(real["gaps"]), _median(real["delays"])  # around real blocks (freeing graphs, bigger grads)
    return {"action_inside": in_action, "action_gap": gap, "p2p_delay": delay, "step_ends": _median(real["ends"]),
            "overhead": in_action + gap,  # the simulator folds the host gap after an action into the action
            # what a waiting consumer sees after the producer's action and its host gap, beyond the bytes on the wire
            "p2p_latency": max(delay - gap - message / links["p2p_bw"], links["latency"]),
            # fixed cost per step and rank (micro-batch split, last sends, losses), beyond the gradient scaling
            "step_overhead": max(_median(real["ends"]) - grad_scale * real["params"][0], 0.0)}


def summarize(raw: list[dict], model_cfg: dict, *, micro_batch_size: int, threads: int, nbytes: int,
              max_wait: float) -> dict:
    """Cluster-yaml numbers from the raw samples of all processes."""
    from . import Model
    from .cost import ring_time

    world = len(raw)
    clean: dict[str, int] = {}

    def pooled(key: str, get) -> float:
        value, n = robust([s for r in raw for s in get(r)], max_wait)
        clean[key] = n
        return value

    layers = {name: [pooled(f"{name}.{d}", lambda r, n=name, d=d: r["layers"][n][d]) for d in ("forward", "backward")]
              for name in ("embedding", "block", "head")}
    solo = [robust(raw[0]["block_solo"][d], max_wait)[0] for d in ("forward", "backward")]
    one_stage = pooled("one_stage_overhead", lambda r: r["overhead"])
    pipe, real = raw[0]["pipeline"], raw[0]["pipeline_block"]
    clean.update({f"pipeline.{k}": len(v) for k, v in pipe.items() if k != "params"})
    clean.update({f"pipeline_block.{k}": len(v) for k, v in real.items() if k != "params"})
    grad_scale = pooled("grad_scale", lambda r: r["grad_scale"])
    links = _links(raw[0]["comm"], world, nbytes, max_wait)
    message = 4 * micro_batch_size * model_cfg["block_size"] * model_cfg["n_embd"]  # fp32 activation
    run = _runtime(pipe, real, grad_scale, links, message)
    block_flops = Model.from_dict(model_cfg).layer_forward_flops()[1] * micro_batch_size * model_cfg["block_size"]
    fwd, bwd = layers["block"]
    g = lambda v: float(f"{v:.4g}")  # noqa: E731  (4 significant digits in the yaml)
    cluster = {
        "achieved_flops": g(block_flops / fwd),
        "backward_factor": round(bwd / fwd, 3),
        "compute_overhead": g(run["overhead"]),
        "grad_scale_time_per_param": g(grad_scale),
        "step_overhead": g(run["step_overhead"]),
        "intra_node_bandwidth": g(links["p2p_bw"]),
        "inter_node_bandwidth": g(links["p2p_bw"]),
        "collective_bandwidth": g(min(links["ring"].values())),
        "latency": g(links["latency"]),
        "p2p_latency": g(run["p2p_latency"]),
        "layer_times": {
            "model": {k: int(model_cfg[k]) for k in SHAPE_KEYS},
            "micro_batch_size": int(micro_batch_size),
            "threads": int(threads),
            "processes": world,
            **{name: [float(f"{v:.5g}") for v in fb] for name, fb in layers.items()},
        },
    }
    info = {"step_ends": run["step_ends"], "one_stage_overhead": one_stage, "action_inside": run["action_inside"],
            "action_gap": run["action_gap"], "p2p_delay": run["p2p_delay"], "block_solo": solo, "clean_samples": clean,
            "ring_bandwidth": links["ring"], "p2p_s": links["p2p_s"],
            "check_ring_time": ring_time(world * nbytes, world, cluster["collective_bandwidth"], links["latency"])}
    return {"cluster": cluster, "info": info}


def save_cluster(path: str | Path, cluster: dict, *, command: str, processes: int, threads: int,
                 clean_samples: dict[str, int]) -> None:
    """Write `cluster` (a base cluster dict updated with ``summarize(...)["cluster"]``) as yaml, under a header
    naming the `command` that measured it, when, and how many samples were clean."""
    header = (f"# Calibrated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
              f"# ({processes} processes x {threads} thread(s); clean samples per measurement: "
              f"{clean_samples}). Seconds, bytes/s, FLOP/s.\n")
    Path(path).write_text(header + yaml.safe_dump(cluster, sort_keys=False))


def load_cluster(path: str | Path) -> dict:
    """A cluster yaml (calibrated or not) as the dict ``sim.Cluster.from_dict`` takes."""
    return yaml.safe_load(Path(path).read_text())
