"""Measure this machine for the simulator and write a cluster yaml (conf/cluster/<name>.yaml). The format, the
fit from samples to its keys and the writing are `lightning_bfpp.sim.calibration`'s; this script measures.

    python examples/calibrate.py --model gpt_small --base cpu_2 --micro-batch-size 4 \
        --out conf/cluster/cpu_2_calibrated.yaml

What is measured, in `devices` (= the base cluster's `devices`, at least 2) gloo processes started like the
real job, each with `torch.set_num_threads(threads)` (default: cores // devices, which is what Lightning's
launcher sets, 1 on a 2-core machine):

- per layer of the example GPT (embedding, one block, head + loss) at the micro-batch size of the run:
  forward and backward seconds, timed on ALL processes at the same time (in a pipelined step every rank
  computes at once, sharing the memory system), under the runtime's saved-tensor hook
  (`SavedActivationMeter`, which the strategy installs in every training step);
- the runtime around the compute, on real 2-stage pipelines (`PipelineRunner`: torch's pipelining runtime
  plus ours, gpipe, stage s on process s): the time inside a forward/backward action of a ~zero-FLOP layer,
  and, with one real block per stage, the host gap between consecutive actions, the delay a waiting
  consumer sees after its producer (p2p as the runtime does it) and the fixed time per step outside the
  actions -> `compute_overhead`, `p2p_latency`, `step_overhead`;
- the per-parameter cost of the 1/m gradient scaling done at each stage's REDUCE_GRAD;
- gloo p2p latency (small ping-pong) and bandwidth (`--message-mb` messages), all-gather and
  reduce-scatter bandwidth (ring model, as `lightning_bfpp.sim.cost.ring_time`).

Noise: each sample also reads the thread's run-queue wait (Linux schedstat: time other processes kept it off
a CPU); samples that waited more than `--max-wait` of their duration are dropped, and the median of the
rest is used (a shared machine otherwise inflates everything). The yaml records how many samples were clean.

The simulator (`lightning_bfpp.sim.Cluster.from_dict`) uses the per-layer times (`layer_times`) for a model
of the same shape (scaled linearly in the micro-batch size), else `achieved_flops` / `backward_factor`.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from procenv import free_port, runqueue_wait  # examples/procenv.py, next to this script

from lightning_bfpp.sim.calibration import SHAPE_KEYS, load_cluster, save_cluster, summarize

ROOT = Path(__file__).resolve().parents[1]




def sample(fn: Callable[[], object], repeats: int, *, prepare: Callable[[], object] | None = None,
           sync: bool = False) -> list[tuple[float, float]]:
    """`repeats` (seconds, run-queue wait seconds) of fn() after one warm-up; `prepare()` runs untimed before
    each; with `sync`, all processes start each sample together (barrier)."""
    out = []
    for i in range(repeats + 1):
        arg = prepare() if prepare is not None else None
        if sync:
            dist.barrier()
        w0, t0 = runqueue_wait(), time.perf_counter()
        fn() if arg is None else fn(arg)
        t1, w1 = time.perf_counter(), runqueue_wait()
        if i:
            out.append((t1 - t0, w1 - w0))
    return out


def _gather(value):
    """All processes' `value` on every process (a list)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ------------------------------------------------------------------------------------------- compute
def measure_layers(model_cfg: dict, micro_batch_size: int, repeats: int, sync: bool, in_flight: int = 4) -> dict:
    """{layer: {"forward": [(s, wait)], "backward": [(s, wait)]}} for embedding, block, head(+loss), timed as
    a pipeline runs them: `in_flight` forwards on fresh inputs, graphs kept, then their backwards in order."""
    import torch.nn.functional as F
    from gpt import Block, Embedding, GPTConfig, Head

    from lightning_bfpp.runtime.instrument import SavedActivationMeter

    cfg = GPTConfig(**{k: model_cfg[k] for k in ("n_layer", *SHAPE_KEYS)})
    torch.manual_seed(0)
    b, t, c = micro_batch_size, cfg.block_size, cfg.n_embd
    idx = torch.randint(0, cfg.vocab_size, (b, t))
    layers = {
        "embedding": (Embedding(cfg), lambda: idx, lambda m, x: m(x)),
        "block": (Block(cfg), lambda: torch.randn(b, t, c, requires_grad=True), lambda m, x: m(x)),
        "head": (Head(cfg), lambda: torch.randn(b, t, c, requires_grad=True),
                 lambda m, x: F.cross_entropy(m(x).reshape(-1, cfg.vocab_size), idx.reshape(-1))),
    }
    out = {}
    for name, (module, make_input, run) in layers.items():
        meter = SavedActivationMeter([module])
        forward_samples, backward_samples = [], []
        for group in range(max(1, repeats // in_flight) + 1):  # the first group is a warm-up
            # `in_flight` micro-batches as a pipeline runs them: forwards on fresh inputs whose graphs stay
            # alive, then the backwards in order (each finds its activations with other work done since)
            pending = []
            if sync:
                dist.barrier()
            for _ in range(in_flight):
                x = make_input()
                w0, t0 = runqueue_wait(), time.perf_counter()
                with meter.track():
                    y = run(module, x)
                sample_ = (time.perf_counter() - t0, runqueue_wait() - w0)
                pending.append((y, None if y.dim() == 0 else torch.ones_like(y)))
                if group:
                    forward_samples.append(sample_)
            if sync:
                dist.barrier()
            for y, g in pending:
                w0, t0 = runqueue_wait(), time.perf_counter()
                with meter.track():
                    y.backward(g)
                if group:
                    backward_samples.append((time.perf_counter() - t0, runqueue_wait() - w0))
            del pending
        out[name] = {"forward": forward_samples, "backward": backward_samples}
        module.zero_grad(set_to_none=True)
    return out


def measure_grad_scale(model_cfg: dict, repeats: int) -> list[tuple[float, float]]:
    """Seconds per parameter of the 1/m gradient scaling at REDUCE_GRAD (one block's gradients)."""
    from gpt import Block, GPTConfig

    block = Block(GPTConfig(**{k: model_cfg[k] for k in ("n_layer", *SHAPE_KEYS)}))
    grads = [torch.randn_like(p) for p in block.parameters()]
    n = sum(g.numel() for g in grads)

    def scale():
        for g in grads:
            g.div_(4)

    return [(s / n, w / n) for s, w in sample(scale, repeats)]


def measure_action_overhead(repeats: int, micro_batches: int = 8) -> list[tuple[float, float]]:
    """Seconds per forward/backward action of the pipelining runtime itself: a one-stage PipelineRunner over
    a ~zero-FLOP layer (step time / number of compute actions), on this process's own 1-rank group."""
    from lightning_bfpp.runtime.pipeline import PipelineRunner
    from lightning_bfpp.schedule import ScheduleSpec, build_schedule

    groups = [dist.new_group([r], backend="gloo") for r in range(dist.get_world_size())]
    own = groups[dist.get_rank()]
    module = torch.nn.Linear(4, 4)
    runner = PipelineRunner(build_schedule(ScheduleSpec("gpipe", pipeline_parallel=1, micro_batches=micro_batches)),
                            {0: module}, torch.device("cpu"), own, lambda y, t: torch.nn.functional.mse_loss(y, t))
    x, y = torch.randn(micro_batches, 4), torch.randn(micro_batches, 4)

    def step():
        runner.train_step(x, y)
        module.zero_grad(set_to_none=True)

    step()  # shape inference
    return [(s / (2 * micro_batches), w / (2 * micro_batches)) for s, w in sample(step, repeats, sync=True)]


class _Scale(torch.nn.Module):
    """A ~zero-FLOP layer (one multiply) that passes an activation of the real shape."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def measure_pipeline(shape: tuple[int, ...], repeats: int, layer: Callable[[], torch.nn.Module] = _Scale,
                     micro_batches: int = 8) -> dict:
    """The runtime's own costs around the compute, on a real pipeline (gpipe over all processes, stage s on
    rank s, one `layer()` per stage) exchanging activations of `shape`. Lists of samples in seconds:
    `durations` of forward/backward actions; `gaps`, host time between consecutive actions of a rank whose
    input was already there (sends, receive posting, loss, freeing the micro-batch's graph); `delays`, from the
    end of a producing action to the start of a consumer on another rank that was waiting for it (the p2p
    message as the runtime sees it); `ends`, step start to first action plus last action to step end
    (micro-batch split, gradient scaling, waiting for sends, losses); `params` of one stage."""
    from lightning_bfpp.runtime.pipeline import PipelineRunner
    from lightning_bfpp.schedule import ScheduleSpec, build_schedule

    rank, world = dist.get_rank(), dist.get_world_size()
    spec = ScheduleSpec("gpipe", pipeline_parallel=world, micro_batches=micro_batches)
    group = dist.new_group(list(range(world)), backend="gloo")
    torch.manual_seed(rank)
    module = layer()
    runner = PipelineRunner(build_schedule(spec), {rank: module}, torch.device("cpu"), group,
                            lambda y, t: (y * t).mean())
    x, y = torch.randn(micro_batches * shape[0], *shape[1:]), torch.randn(micro_batches * shape[0], *shape[1:])

    def step():
        start = time.perf_counter()
        runner.train_step(x, y)
        end = time.perf_counter()
        module.zero_grad(set_to_none=True)
        return start, end

    step()  # shape inference
    steps = []
    for _ in range(repeats):
        dist.barrier()
        w0 = runqueue_wait()
        start, end = step()
        steps.append((list(runner.timeline.events), runqueue_wait() - w0, end - start, start, end))
    everyone = _gather(steps)
    out: dict[str, list[float]] = {"durations": [], "gaps": [], "delays": [], "ends": []}
    for i in range(repeats):
        if any(r[i][1] > max(0.1 * r[i][2], 0.003) for r in everyone):
            continue  # a step another process interfered with
        events = {(k, s, mb): (t0, t1) for r in everyone for (k, s, mb, t0, t1) in r[i][0]}
        seqs = [sorted((t0, t1, k, s, mb) for (k, s, mb), (t0, t1) in events.items() if s == r) for r in range(world)]
        # the first stage's rank starts computing at once; the others' lead is the pipeline fill, not overhead
        lead = seqs[0][0][0] - everyone[0][i][3]
        for r, seq in enumerate(seqs):
            out["ends"].append(lead + (everyone[r][i][4] - seq[-1][1]))
            for j, (t0, t1, k, s, mb) in enumerate(seq):
                out["durations"].append(t1 - t0)
                if not j:
                    continue
                producer = (k, s - 1, mb) if k == "F" else ((k, s + 1, mb) if s + 1 < world else ("F", s, mb))
                ready = events[producer][1] if producer in events else float("-inf")
                prev_end = seq[j - 1][1]
                if ready <= prev_end:
                    out["gaps"].append(t0 - prev_end)
                elif producer[1] != s:
                    out["delays"].append(t0 - ready)
    out["params"] = [float(sum(p.numel() for p in module.parameters()))]
    return out


# ------------------------------------------------------------------------------------------- communication
def measure_comm(nbytes: int, repeats: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    big, small = torch.zeros(nbytes // 4), torch.zeros(1)

    def ping_pong(t):
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)

    lat = sample(lambda: ping_pong(small), repeats, sync=True)
    p2p = sample(lambda: ping_pong(big), repeats, sync=True)
    gathered = torch.zeros(world * big.numel())
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = sample(lambda: all_gather(gathered, big), repeats, sync=True)
    rs_out = torch.zeros(big.numel())
    rs = sample(lambda: reduce_scatter(rs_out, gathered), repeats, sync=True)
    return {"ping_pong_small": lat, "ping_pong_big": p2p, "all_gather": ag, "reduce_scatter": rs}


def _worker(rank: int, world: int, port: int, threads: int, args: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = {"layers": measure_layers(args["model_cfg"], args["micro_batch_size"], args["repeats"], sync=True)}
        # the same block with the other processes idle (informational: contention between ranks)
        dist.barrier()
        if rank == 0:
            res["block_solo"] = measure_layers(args["model_cfg"], args["micro_batch_size"], args["repeats"],
                                               sync=False)["block"]
        dist.barrier()
        res["grad_scale"] = measure_grad_scale(args["model_cfg"], args["repeats"])
        res["overhead"] = measure_action_overhead(args["repeats"])
        mbs, cfg = args["micro_batch_size"], args["model_cfg"]
        shape = (mbs, cfg["block_size"], cfg["n_embd"])
        res["pipeline"] = measure_pipeline(shape, args["repeats"])  # ~zero FLOPs: the cost inside an action
        from gpt import Block, GPTConfig

        block_cfg = GPTConfig(**{k: cfg[k] for k in ("n_layer", *SHAPE_KEYS)})
        # one real block per stage: host gaps, p2p delays and step ends around realistic actions
        res["pipeline_block"] = measure_pipeline(shape, max(5, args["repeats"] // 2), lambda: Block(block_cfg), 4)
        res["comm"] = measure_comm(args["nbytes"], args["repeats"])
        everyone = _gather(res)
        if rank == 0:
            queue.put(everyone)
        dist.barrier()
    finally:
        dist.destroy_process_group()



def run_measurements(model_cfg: dict, *, devices: int, threads: int, micro_batch_size: int, repeats: int,
                     nbytes: int) -> list[dict]:
    """Per process, the raw samples of every measurement (see the module docstring)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = {"model_cfg": model_cfg, "micro_batch_size": micro_batch_size, "repeats": repeats, "nbytes": nbytes}
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, devices, port, threads, args, queue)) for r in range(devices)]
    for p in procs:
        p.start()
    import queue as queue_module

    try:
        deadline = time.monotonic() + 600
        while True:  # a worker that dies (exit code != 0) fails the command at once instead of a 10-minute wait
            try:
                return queue.get(timeout=2)
            except queue_module.Empty as err:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"calibration workers failed (exit codes {failed}) or timed out; see their "
                                       "output above") from err
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def calibrate(model: str = "gpt_small", base: str = "cpu_2", *, micro_batch_size: int = 4, repeats: int = 15,
              message_mb: float = 1.0, threads: int | None = None, max_wait: float = 0.03,
              out: str | Path | None = None, verbose: bool = True) -> dict:
    """Measure, and return (and write to `out`) the calibrated cluster dict."""
    model_cfg = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    base_cfg = load_cluster(ROOT / "conf" / "cluster" / f"{base}.yaml")
    devices = max(2, int(base_cfg["devices"]))
    threads = threads or max(1, (os.cpu_count() or 2) // devices)  # Lightning's launcher: cores // processes
    nbytes = int(message_mb * 1e6) // 4 * 4
    started = time.time()
    raw = run_measurements(model_cfg, devices=devices, threads=threads, micro_batch_size=micro_batch_size,
                           repeats=repeats, nbytes=nbytes)
    summary = summarize(raw, model_cfg, micro_batch_size=micro_batch_size, threads=threads, nbytes=nbytes,
                        max_wait=max_wait)
    cluster = dict(base_cfg)
    cluster["name"] = Path(out).stem if out else f"{base}_calibrated"
    cluster.update(summary["cluster"])
    info = summary["info"]
    if verbose:
        lt = cluster["layer_times"]
        print(f"calibrated in {time.time() - started:.0f}s on {devices} processes x {threads} thread(s), "
              f"micro-batch {micro_batch_size} of {model}:")
        for name in ("embedding", "block", "head"):
            print(f"  {name:9s} forward {lt[name][0] * 1e3:7.2f} ms   backward {lt[name][1] * 1e3:7.2f} ms")
        print(f"  block alone (other processes idle): forward {info['block_solo'][0] * 1e3:.2f} ms, backward "
              f"{info['block_solo'][1] * 1e3:.2f} ms")
        print(f"  achieved {cluster['achieved_flops'] / 1e9:.1f} GFLOP/s per process, backward/forward "
              f"{cluster['backward_factor']:.2f}, runtime overhead {cluster['compute_overhead'] * 1e3:.3f} ms per "
              f"action, grad scaling {cluster['grad_scale_time_per_param'] * 1e9:.2f} ns/param")
        print(f"  runtime: {info['action_inside'] * 1e3:.3f} ms inside an action (~zero-FLOP layers); around one-block "
              f"stages: {info['action_gap'] * 1e3:.3f} ms host gap between actions, {info['p2p_delay'] * 1e3:.3f} ms "
              f"from a producer's end to a waiting consumer's start, {info['step_ends'] * 1e3:.3f} ms per step before "
              f"the first and after the last action (one-stage runner: {info['one_stage_overhead'] * 1e3:.3f} "
              "ms/action)")
        print(f"  gloo: latency {cluster['latency'] * 1e6:.0f} us (runtime p2p {cluster['p2p_latency'] * 1e6:.0f} us), "
              f"p2p {cluster['intra_node_bandwidth'] / 1e9:.2f} GB/s, "
              f"all-gather {info['ring_bandwidth']['all_gather'] / 1e9:.2f} GB/s, reduce-scatter "
              f"{info['ring_bandwidth']['reduce_scatter'] / 1e9:.2f} GB/s (ring model)")
        print(f"  clean samples (run-queue wait <= {max_wait:.0%}): {info['clean_samples']}")
    if out:
        shown = Path(out).resolve()
        shown = shown.relative_to(ROOT) if ROOT in shown.parents else shown
        command = (f"python examples/calibrate.py --model {model} --base {base} --micro-batch-size {micro_batch_size} "
                   f"--out {shown}")
        save_cluster(out, cluster, command=command, processes=devices, threads=threads,
                     clean_samples=info["clean_samples"])
        if verbose:
            print(f"wrote {out}")
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_small", help="conf/model/<name>.yaml whose layers are timed")
    parser.add_argument("--base", default="cpu_2", help="conf/cluster/<name>.yaml: devices and the other keys")
    parser.add_argument("--out", default=None, help="cluster yaml to write (default: print only)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch of the real run")
    parser.add_argument("--threads", type=int, default=None, help="threads per process (default cores // devices)")
    parser.add_argument("--message-mb", type=float, default=1.0, help="message size for bandwidth, MB")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--max-wait", type=float, default=0.03,
                        help="drop samples whose run-queue wait exceeds this fraction of their time")
    args = parser.parse_args()
    cluster = calibrate(args.model, args.base, micro_batch_size=args.micro_batch_size, repeats=args.repeats,
                        message_mb=args.message_mb, threads=args.threads, max_wait=args.max_wait, out=args.out)
    if not args.out:
        print(yaml.safe_dump(cluster, sort_keys=False))


if __name__ == "__main__":
    main()
