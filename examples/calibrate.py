"""Measure this machine for the simulator: achieved FLOP/s of the example GPT block (plain torch) and
gloo p2p / all-gather bandwidth between local processes; write a cluster yaml the planner can use.

    python examples/calibrate.py --model gpt_small --base cpu_2 --out conf/cluster/cpu_2_calibrated.yaml

Short runs (a few seconds); numbers on a shared machine are noisy: compare ratios, rerun when in doubt.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_block(model_cfg: dict, micro_batch_size: int, repeats: int) -> dict:
    """Forward and backward seconds of one transformer block; achieved FLOP/s by the simulator's count."""
    from gpt import Block, GPTConfig

    from lightning_bfpp.sim import Model

    keys = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
    block = Block(GPTConfig(**{k: model_cfg[k] for k in keys}))
    x = torch.randn(micro_batch_size, model_cfg["block_size"], model_cfg["n_embd"], requires_grad=True)
    fwd = _median_time(lambda: block(x), repeats)

    def fwd_bwd():
        block(x).sum().backward()

    total = _median_time(fwd_bwd, repeats)
    tiny = torch.randn(1, 1, model_cfg["n_embd"], requires_grad=True)  # ~no FLOPs: the fixed cost of an action

    def tiny_fwd_bwd():
        block(tiny).sum().backward()

    overhead = _median_time(tiny_fwd_bwd, repeats) / 2
    flops = Model.from_dict(model_cfg).layer_forward_flops()[1] * micro_batch_size * model_cfg["block_size"]
    return {"forward_s": fwd, "backward_s": total - fwd, "backward_over_forward": (total - fwd) / fwd,
            "achieved_flops": flops / max(fwd - overhead, 1e-9), "compute_overhead": overhead}


def _comm_worker(rank: int, world: int, port: int, nbytes: int, repeats: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    big = torch.zeros(nbytes // 4)
    small = torch.zeros(1)

    def p2p(t):
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)

    lat = _median_time(lambda: p2p(small), repeats) / 2  # one way
    p2p_s = _median_time(lambda: p2p(big), repeats) / 2
    gathered = torch.zeros(world * big.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ag_s = _median_time(lambda: gather(gathered, big), repeats)
    if rank == 0:
        out.put({"latency": lat, "p2p_bandwidth": nbytes / max(p2p_s - lat, 1e-9),
                 # ring model: all-gather of the full tensor (world * nbytes) takes (w-1)/w * full / bw
                 "allgather_bandwidth": (world - 1) * nbytes / max(ag_s - (world - 1) * lat, 1e-9)})
    dist.barrier()
    dist.destroy_process_group()


def measure_comm(world: int, nbytes: int, repeats: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_comm_worker, args=(world, port, nbytes, repeats, out), nprocs=world, start_method="spawn")
    return out.get(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_small", help="conf/model/<name>.yaml whose block is timed")
    parser.add_argument("--base", default="cpu_2", help="conf/cluster/<name>.yaml to copy the other keys from")
    parser.add_argument("--out", default=None, help="cluster yaml to write (default: print only)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--message-mb", type=float, default=4.0, help="message size for bandwidth, MB")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    model_cfg = yaml.safe_load((ROOT / "conf" / "model" / f"{args.model}.yaml").read_text())
    base = yaml.safe_load((ROOT / "conf" / "cluster" / f"{args.base}.yaml").read_text())
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(1, base["devices"])))  # like one rank of the job
    block = measure_block(model_cfg, args.micro_batch_size, args.repeats)
    world = max(2, min(int(base["devices"]), 4))
    comm = measure_comm(world, int(args.message_mb * 1e6), args.repeats)
    print(f"block ({args.model}, micro-batch {args.micro_batch_size}): forward {block['forward_s'] * 1e3:.2f} ms, "
          f"backward {block['backward_s'] * 1e3:.2f} ms (x{block['backward_over_forward']:.2f}), "
          f"achieved {block['achieved_flops'] / 1e9:.1f} GFLOP/s, fixed cost per action "
          f"{block['compute_overhead'] * 1e3:.2f} ms")
    print(f"gloo, {world} processes: latency {comm['latency'] * 1e6:.0f} us, p2p {comm['p2p_bandwidth'] / 1e9:.2f} GB/s, "
          f"all-gather (ring model) {comm['allgather_bandwidth'] / 1e9:.2f} GB/s")
    cluster = dict(base)
    cluster.update(
        name=Path(args.out).stem if args.out else f"{args.base}_calibrated",
        achieved_flops=float(f"{block['achieved_flops']:.3g}"),
        compute_overhead=float(f"{block['compute_overhead']:.3g}"),
        intra_node_bandwidth=float(f"{min(comm['p2p_bandwidth'], comm['allgather_bandwidth']):.3g}"),
        inter_node_bandwidth=float(f"{min(comm['p2p_bandwidth'], comm['allgather_bandwidth']):.3g}"),
        latency=float(f"{comm['latency']:.3g}"),
    )
    if args.out:
        header = (f"# Calibrated by examples/calibrate.py --model {args.model} --base {args.base} on "
                  f"{time.strftime('%Y-%m-%d')}: block backward/forward = {block['backward_over_forward']:.2f}\n")
        Path(args.out).write_text(header + yaml.safe_dump(cluster, sort_keys=False))
        print(f"wrote {args.out}")
    else:
        print(yaml.safe_dump(cluster, sort_keys=False))


if __name__ == "__main__":
    main()
