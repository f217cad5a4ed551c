"""Simulated mixtures of experts on 64-512 GPUs: breadth-first against 1F1B and a Megatron-like baseline, each with and
without overlapping the experts' all-to-alls with the neighbouring micro-batch's compute.

    python examples/moe_reproduction.py            # ~1-2 min; writes docs/moe_reproduction.png and _tables.md

For each model, cluster size and method, the planner's search restricted to that method picks the best layout
(pipeline_parallel, loops, micro-batches, expert_parallel, reshard policy) that fits in memory, at one 4096-token
sequence per GPU. Models: conf/model/mixtral_8x22b.yaml (8 experts: expert parallel stays inside a node) and
conf/model/deepseek_v3_like.yaml (256 experts: expert parallel up to 64, across nodes; it fits from 256 GPUs), both
with activation checkpointing; cluster: conf/cluster/a100_paper.yaml (8 A100-80GB per node, 25 GB/s per GPU between
nodes). Every method searches the same space with the same cost model; tensor parallel is off (under it the runtime
computes the router and experts whole on every tp rank: tp would split attention only), as in DeepSeek-V3's own
training (pp x ep, no tp); a last table per model searches expert x tensor parallel for breadth-first.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import yaml

from lightning_bfpp.sim import MEGATRON, Cluster, Model, SimOptions
from lightning_bfpp.sim.planner import Plan, search

ROOT = Path(__file__).resolve().parents[1]
OVERLAP = SimOptions(expert_overlap=True)
# label: (schedules, sharding, how the runtime waits); "+ overlap" variants add expert_overlap
METHODS = {
    "breadth_first": (["breadth_first"], "full", SimOptions()),
    "1f1b": (["1f1b"], "full", SimOptions()),
    # Megatron-LM: 1F1B or interleaved 1F1B (depth_first, pp > 2), distributed optimizer, gradient reduction after
    # the flush, blocking p2p (sim.MEGATRON); Megatron-Core's expert parallel with its all-to-all dispatcher
    "megatron_like": (["1f1b", "depth_first"], "optimizer", MEGATRON),
}
MODELS = {"mixtral_8x22b": (8, 16, 32, 64), "deepseek_v3_like": (32, 64)}  # model: nodes of 8 GPUs
BETA = 1  # 4096-token sequences per GPU


def load(model: str, cluster: str) -> tuple[Model, Cluster]:
    m = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    c = yaml.safe_load((ROOT / "conf" / "cluster" / f"{cluster}.yaml").read_text())
    return Model.from_dict(m), Cluster.from_dict(c)


def best(model: Model, cluster: Cluster, method: str, overlap: bool, beta: float = BETA,
         tensor_parallels: tuple[int, ...] = (1,)) -> Plan | None:
    """The fastest fitting layout of `method` (with the experts' all-to-alls overlapped or not); `tensor_parallels`
    beyond 1 searches expert x tensor parallel too (with and without sequence parallel)."""
    schedules, sharding, options = METHODS[method]
    options = replace(options, expert_overlap=overlap)
    experts = tuple(e for e in (1, 2, 4, 8, 16, 32, 64) if model.n_experts % e == 0)
    found = []
    for name in schedules:
        found += search(model, cluster, int(beta * cluster.world_size), options=options, top=1, schedules=[name],
                        shardings=[sharding], loops=(1, 2, 4, 8), max_groups=8, tensor_parallels=tensor_parallels,
                        sequence_parallels=(False, True) if max(tensor_parallels) > 1 else (False,),
                        expert_parallels=experts,
                        min_pipeline_parallel=3 if name == "depth_first" else 1,  # Megatron's interleaving rule
                        max_micro_batches=64)
    found = [p for p in found if p.fits]
    return max(found, key=lambda p: p.tokens_per_second_per_device) if found else None


def sweep(model: Model, cluster: Cluster, nodes: tuple[int, ...]) -> dict:
    return {(n, method, overlap): best(model, replace(cluster, num_nodes=n), method, overlap)
            for n in nodes for method in METHODS for overlap in (False, True)}


def _layout(p: Plan | None) -> str:
    if p is None:
        return "does not fit"
    c = p.candidate
    extra = f" g{c.groups}" if c.groups > 1 else ""
    extra += " raf" if c.reshard_after_forward else ""
    extra += f" {c.residency}{c.cache or ''}" if c.residency != "step" else ""
    tp = f" tp{c.tensor_parallel}{'s' if c.sequence_parallel else ''}" if c.tensor_parallel > 1 else ""
    return (f"{c.schedule[:5]} pp{c.pipeline_parallel}{tp} ep{c.expert_parallel} l{c.loops} "
            f"m{c.micro_batches}×{c.micro_batch_size}{extra}")


def _tflops(p: Plan | None, fpt: float) -> str:
    return "—" if p is None else f"{p.tokens_per_second_per_device * fpt / 1e12:.0f}"


def _ratio(a: Plan | None, b: Plan | None) -> str:
    return "—" if a is None or b is None else f"{a.tokens_per_second_per_device / b.tokens_per_second_per_device:.2f}"


def tables(name: str, model: Model, results: dict, nodes: tuple[int, ...]) -> str:
    fpt = model.flops_per_token()
    cols = [(m, o) for m in METHODS for o in (False, True)]
    head = " | ".join(f"{m.replace('_', ' ')}{' + overlap' if o else ''}" for m, o in cols)
    rows = [f"Model TFLOP/s per GPU ({name}, {model.flops_per_token() / 1e9:.0f} GFLOP per token):", "",
            f"| GPUs | {head} | BF+o / 1F1B+o | BF+o / Megatron+o | overlap gain (BF) |",
            "|---" * (len(cols) + 4) + "|"]
    for n in nodes:
        r = {k: results[(n, *k)] for k in cols}
        bf, bfo = r[("breadth_first", False)], r[("breadth_first", True)]
        rows.append(f"| {8 * n} | " + " | ".join(_tflops(r[k], fpt) for k in cols) + f" | "
                    f"{_ratio(bfo, r[('1f1b', True)])} | {_ratio(bfo, r[('megatron_like', True)])} | "
                    f"{_ratio(bfo, bf)} |")
    rows += ["", "Chosen layouts (schedule, pipeline ranks, expert parallel, loops, micro-batches × size; groups, "
                 "reshard after forward and weight residency when not the default):", "", f"| GPUs | {head} |",
             "|---" * (len(cols) + 1) + "|"]
    for n in nodes:
        rows.append(f"| {8 * n} | " + " | ".join(_layout(results[(n, *k)]) for k in cols) + " |")
    return "\n".join(rows)


def tensor_parallel_table(name: str, model: Model, cluster: Cluster, nodes: tuple[int, ...]) -> str:
    """Breadth-first with the all-to-alls overlapped: its best layout without tensor parallel against the best with
    expert x tensor parallel searched (tp 1, 2, 4, 8 in a node; the mixture whole on every tp rank, attention split)."""
    fpt = model.flops_per_token()
    rows = [f"Breadth-first + overlap, expert x tensor parallel searched ({name}; model TFLOP/s per GPU):", "",
            "| GPUs | tp = 1 | tp searched | gain | layout (tp searched) |", "|---|---|---|---|---|"]
    for n in nodes:
        cl = replace(cluster, num_nodes=n)
        off, on = best(model, cl, "breadth_first", True), best(model, cl, "breadth_first", True,
                                                               tensor_parallels=(1, 2, 4, 8))
        rows.append(f"| {8 * n} | {_tflops(off, fpt)} | {_tflops(on, fpt)} | {_ratio(on, off)} | {_layout(on)} |")
    return "\n".join(rows)


def figure(panels: list[tuple[str, Model, dict, tuple[int, ...]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
    style = {"breadth_first": ("o", "C0"), "1f1b": ("^", "C1"), "megatron_like": ("D", "C3")}
    for ax, (name, model, results, nodes) in zip(axes[0], panels):
        fpt = model.flops_per_token()
        for method, (marker, color) in style.items():
            for overlap in (False, True):
                xs = [8 * n for n in nodes if results[(n, method, overlap)] is not None]
                ys = [results[(x // 8, method, overlap)].tokens_per_second_per_device * fpt / 1e12 for x in xs]
                ax.plot(xs, ys, marker=marker, color=color, ls="-" if overlap else ":", ms=5,
                        label=f"{method.replace('_', ' ')}{' + overlap' if overlap else ''}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([8 * n for n in nodes], [str(8 * n) for n in nodes])
        ax.set_xlabel("GPUs (A100-80GB, 8 per node)")
        ax.set_title(f"{name}, one 4096-token sequence per GPU", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("simulated model TFLOP/s per GPU")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="a100_paper")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    panels, text = [], []
    for name, nodes in MODELS.items():
        model, cluster = load(name, args.cluster)
        results = sweep(model, cluster, nodes)
        panels.append((name, model, results, nodes))
        text += [f"### {name}", "", tables(name, model, results, nodes), "",
                 tensor_parallel_table(name, model, cluster, nodes), ""]
    figure(panels, out / "moe_reproduction.png")
    head = f"<!-- generated by: python examples/moe_reproduction.py ({time.perf_counter() - start:.0f} s) -->"
    (out / "moe_reproduction_tables.md").write_text("\n".join([head, *text]))
    print("\n".join([head, *text]))


if __name__ == "__main__":
    main()
