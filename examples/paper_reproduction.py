"""Simulated reproduction of arXiv 2211.05953's throughput comparison (52B GPT on A100s).

    python examples/paper_reproduction.py            # ~14 min on 2 loaded cores; writes docs/paper_reproduction_*

For each batch size per GPU and each schedule, the planner's search restricted to that schedule picks the
best layout (pp, loops, micro-batch count/size, groups, reshard policy) that fits in memory. The same
cost model, cluster and search space serve every schedule; nothing is tuned per schedule.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

from lightning_bfpp.sim import MEGATRON, Cluster, Model, SimOptions
from lightning_bfpp.sim.planner import search, simulate_candidate

ROOT = Path(__file__).resolve().parents[1]
BETAS = (0.125, 0.25, 0.5, 1, 2, 4, 8)  # batch size (sequences) per GPU
# label: (schedules, shardings, waits, (min pp, max pp), tensor-parallel sizes, sequence parallel choices).
# Every method may use tensor parallel with sequence parallel (cost model only for our runtime, which has no
# sequence parallel yet; Megatron-LM has both), so the comparison is of schedules, not of tp implementations.
SP = (False, True)
MODES = {
    "breadth_first": (["breadth_first"], ["full"], SimOptions(), (2, None), None, SP),
    # breadth-first with each backward split, the weight-gradient passes filling idle time (zero bubble)
    "breadth_first_zb": (["breadth_first_zb"], ["full"], SimOptions(), (2, None), None, SP),
    "depth_first": (["depth_first"], ["full"], SimOptions(), (2, None), None, SP),
    "1f1b": (["1f1b"], ["full"], SimOptions(), (2, None), None, SP),
    "gpipe": (["gpipe"], ["full"], SimOptions(), (2, None), None, SP),
    # Megatron-LM as it runs (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    # Clusters Using Megatron-LM"; Korthikanti et al. 2022 "Reducing Activation Recomputation"; Megatron-LM's
    # distributed-optimizer docs): tp = 8 inside a node with sequence parallel, pp across nodes, 1F1B or
    # interleaved 1F1B (= depth_first; only when pp > 2, as Megatron requires), distributed optimizer
    # (optimizer state / dp, bf16 weights and fp32 main grads whole), gradient reduce-scatter + parameter
    # all-gather after the last backward, not overlapped; blocking p2p (sim.MEGATRON).
    "megatron_like": (["1f1b", "depth_first"], ["optimizer"], MEGATRON, (1, None), (8,), (True,)),
    # the planner's pick: every schedule, pp, tp, sharding (full / none), weight residency
    "planner": (["gpipe", "1f1b", "depth_first", "breadth_first", "breadth_first_zb"], ["full", "none"], SimOptions(),
                (1, None), None, SP),
}


def load(model: str, cluster: str) -> tuple[Model, Cluster]:
    m = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    c = yaml.safe_load((ROOT / "conf" / "cluster" / f"{cluster}.yaml").read_text())
    return Model.from_dict(m), Cluster.from_dict(c)


def best(model: Model, cluster: Cluster, beta: float, mode: str, cross_step: tuple[bool, ...] = (False, True)):
    """The best fitting layout of `mode`; our runtime's modes also try cross-step overlap (`cross_step`), which helps
    only where the cluster has host time between steps (``step_overhead``; none in a100_paper)."""
    schedules, shardings, options, (min_pp, max_pp), tps, sps = MODES[mode]
    batch = int(beta * cluster.world_size)
    found = []
    for name in schedules:  # interleaved 1F1B only with pp > 2 (Megatron-LM's rule)
        lo = max(min_pp, 3) if mode == "megatron_like" and name == "depth_first" else min_pp
        found += search(model, cluster, batch, options=options, top=1, schedules=[name], shardings=shardings,
                        min_pipeline_parallel=lo, max_pipeline_parallel=max_pp, tensor_parallels=tps,
                        sequence_parallels=sps, cross_step_overlaps=(False,) if mode == "megatron_like" else cross_step)
    found = [p for p in found if p.fits]
    return max(found, key=lambda p: p.tokens_per_second_per_device) if found else None


def cross_step_table(model: Model, cluster: Cluster, overheads=(0.0, 0.005, 0.010), betas=(0.125,)) -> str:
    """BF and BF-ZB with and without cross-step overlap as the host time between steps grows (``step_overhead``:
    none in a100_paper; the H200 run measured ~10 ms a step outside kernels), model TFLOP/s per GPU and % of the
    compute-bound limit. One search per mode and host time: its plans hold both (search(cross_step_overlaps=...))."""
    fpt, bound = model.flops_per_token(), cluster.flops
    rows = ["| sequences/GPU | host time between steps | BF | BF, cross-step | BF-ZB | BF-ZB, cross-step | "
            "gain (BF-ZB) |", "|---|---|---|---|---|---|---|"]
    for beta in betas:
        for overhead in overheads:
            cl, cells, gain = replace(cluster, step_overhead=overhead), [], 0.0
            for mode in ("breadth_first", "breadth_first_zb"):
                schedules, shardings, options, (min_pp, _), tps, sps = MODES[mode]
                # the best without, then the best with cross-step overlap allowed (the second search reuses the
                # first's simulated steps); only a search's first plan is certain (the rest are pruned)
                pair = [next(p for p in search(model, cl, int(beta * cl.world_size), options=options, top=1,
                                               schedules=schedules, shardings=shardings, min_pipeline_parallel=min_pp,
                                               tensor_parallels=tps, sequence_parallels=sps,
                                               cross_step_overlaps=overlaps) if p.fits)
                        for overlaps in ((False,), (False, True))]
                for p in pair:
                    tflops = p.tokens_per_second_per_device * fpt / 1e12
                    cells.append(f"{tflops:.1f} ({tflops * 1e12 / bound:.1%})")
                gain = pair[1].tokens_per_second_per_device / pair[0].tokens_per_second_per_device
            rows.append(f"| {beta:g} | {overhead * 1e3:g} ms | " + " | ".join(cells) + f" | {gain:.3f} |")
    return "\n".join(rows)


def shard_unit_table(model: Model, cluster: Cluster, beta: float = 0.125, loops=(2, 4, 8, None)) -> str:
    """BF-ZB at `beta` sequences per GPU, cross-step overlap searched: the best layout with each stage one FSDP unit
    against the best with one unit per layer allowed (``search(shard_units=...)``), per number of loops (None: any).
    Model TFLOP/s per GPU and % of the compute-bound limit."""
    fpt, bound = model.flops_per_token(), cluster.flops
    schedules, shardings, options, (min_pp, _), tps, sps = MODES["breadth_first_zb"]
    rows = ["| loops | one unit per stage | one unit per layer allowed | its layout | gain |", "|---|---|---|---|---|"]
    for n in loops:
        pair = []
        for units in (("stage",), ("stage", "layer")):
            plans = [p for p in search(model, cluster, int(beta * cluster.world_size), options=options, top=1,
                                       schedules=schedules, shardings=shardings, min_pipeline_parallel=min_pp,
                                       tensor_parallels=tps, sequence_parallels=sps, cross_step_overlaps=(False, True),
                                       shard_units=units, **({"loops": (n,)} if n else {})) if p.fits]
            pair.append(plans[0] if plans else None)
        if None in pair:
            rows.append(f"| {n or 'any'} | does not fit | | | |")
            continue
        cells = [f"{p.tokens_per_second_per_device * fpt / 1e12:.1f} "
                 f"({p.tokens_per_second_per_device * fpt / bound:.1%})" for p in pair]
        gain = pair[1].tokens_per_second_per_device / pair[0].tokens_per_second_per_device
        rows.append(f"| {n or 'any'} | {cells[0]} | {cells[1]} | {_layout(pair[1])} | {gain:.3f} |")
    return "\n".join(rows)


def possible(cluster: Cluster, beta: float, mode: str) -> bool:
    """Whether any layout exists at all (the global batch must split over dp = world / pp replicas)."""
    batch, (min_pp, max_pp), tps = int(beta * cluster.world_size), MODES[mode][3], MODES[mode][4] or (1, 2, 4, 8)
    pps = [p for p in range(min_pp, (max_pp or cluster.world_size) + 1) if cluster.world_size % p == 0]
    return any(batch and cluster.world_size % (pp * t) == 0 and batch % (cluster.world_size // (pp * t)) == 0
               for pp in pps for t in tps)


def progress(what: str, since: float) -> None:
    """One line on stderr per finished piece (the tables go to stdout): a long run shows where it is."""
    print(f"[{time.perf_counter() - since:7.0f} s] {what}", file=sys.stderr, flush=True)


def sweep(model: Model, cluster: Cluster, betas=BETAS, modes=tuple(MODES)) -> dict:
    results, start = {}, time.perf_counter()
    for beta in betas:
        for mode in modes:
            results[beta, mode] = best(model, cluster, beta, mode)
        progress(f"{cluster.world_size} GPUs, beta {beta:g}: {len(modes)} methods planned", start)
    return {k: ("n/a" if v is None and not possible(cluster, *k) else v) for k, v in results.items()}


def _fmt(p) -> str:
    return "—" if p is None or p == "n/a" else f"{p.tokens_per_second_per_device:.0f}"


def _layout(p) -> str:
    if p == "n/a":
        return "n/a (batch < dp)"
    if p is None:
        return "does not fit"
    c = p.candidate
    extra = f" g{c.groups}" if c.groups > 1 else ""
    extra += " raf" if c.reshard_after_forward else ""
    extra += f" {c.sharding}" if c.sharding != "full" else ""
    extra += f" {c.residency}{c.cache or ''}" if c.residency != "step" else ""
    extra += " cross-step" if c.cross_step_overlap else ""
    extra += " per-layer units" if c.shard_unit == "layer" else ""
    cp = f" cp{c.context_parallel}" if c.context_parallel > 1 else ""
    name = "bf-zb" if c.schedule == "breadth_first_zb" else c.schedule[:5]
    return (f"{name} tp{c.tensor_parallel}{'s' if c.sequence_parallel else ''}{cp} pp{c.pipeline_parallel} "
            f"l{c.loops} m{c.micro_batches}×{c.micro_batch_size}{extra}")


def _ratio(a, b) -> str:
    if a in (None, "n/a") or b in (None, "n/a"):
        return "—"
    return f"{a.tokens_per_second_per_device / b.tokens_per_second_per_device:.2f}"


def _tflops(p, flops_per_token: float, bound: float) -> str:
    if p in (None, "n/a"):
        return "—"
    achieved = p.tokens_per_second_per_device * flops_per_token
    return f"{achieved / 1e12:.1f} ({achieved / bound:.1%})"


def tables(results: dict, betas, peak: float, flops_per_token: float, bound: float) -> str:
    """Tokens/s per GPU of each mode's best layout, BF's ratios, model TFLOP/s (and the share of `bound`, the
    compute-bound FLOP/s per GPU), the chosen layouts."""
    rows = ["| batch/GPU | " + " | ".join(MODES) + " | BF/DF | BF/1F1B | BF/Megatron | BF MFU |",
            "|---" * (len(MODES) + 5) + "|"]
    for beta in betas:
        r = {m: results[(beta, m)] for m in MODES}
        bf = r["breadth_first"]
        mfu = "—" if bf in (None, "n/a") else f"{bf.tokens_per_second_per_device * flops_per_token / peak:.1%}"
        rows.append(f"| {beta:g} | " + " | ".join(_fmt(r[m]) for m in MODES) + f" | {_ratio(bf, r['depth_first'])} | "
                    f"{_ratio(bf, r['1f1b'])} | {_ratio(bf, r['megatron_like'])} | {mfu} |")
    rows += ["", f"Model TFLOP/s per GPU ({flops_per_token / 1e9:.4g} GFLOP per token; % of the compute-bound limit, "
             "peak × achieved compute):", "", "| batch/GPU | " + " | ".join(MODES) + " |",
             "|---" * (len(MODES) + 1) + "|"]
    for beta in betas:
        rows.append(f"| {beta:g} | " + " | ".join(_tflops(results[(beta, m)], flops_per_token, bound) for m in MODES)
                    + " |")
    rows += ["", "Chosen layouts (pp, loops, micro-batches × size, groups, reshard after forward):", "",
             "| batch/GPU | " + " | ".join(MODES) + " |", "|---" * (len(MODES) + 1) + "|"]
    for beta in betas:
        rows.append(f"| {beta:g} | " + " | ".join(_layout(results[(beta, m)]) for m in MODES) + " |")
    return "\n".join(rows)


def figure(panels: list[tuple[dict, str]], betas, path: Path, flops_per_token: float, peak_limit: float) -> None:
    """Model TFLOP/s per GPU vs sequences per GPU, one panel per cluster size (the paper's Figure layout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), sharey=True, squeeze=False)
    axes = axes[0]
    style = {"breadth_first": "o-", "breadth_first_zb": "P-", "depth_first": "s--", "1f1b": "^-.", "gpipe": "v:",
             "planner": "k*:", "megatron_like": "D-"}
    for ax, (results, title) in zip(axes, panels):
        for mode in MODES:
            xs = [b for b in betas if results[(b, mode)] not in (None, "n/a")]
            ys = [results[(b, mode)].tokens_per_second_per_device * flops_per_token / 1e12 for b in xs]
            ax.plot(xs, ys, style[mode], label=mode.replace("_", " "), ms=5)
        ax.axhline(peak_limit / 1e12, color="grey", lw=0.8, ls="--", label="compute-bound")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(betas), [f"{b:g}" for b in betas])
        ax.set_xlabel("batch size per GPU (sequences of 1024 tokens)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("simulated model TFLOP/s per GPU")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep_table(model: Model, knob: str, clusters: list[tuple[float, Cluster]], betas) -> str:
    """One row per (knob value, batch per GPU): the best plan of each method and BF's speed-up over each."""
    rows = [f"| {knob} | batch/GPU | BF | DF | 1F1B | Megatron-like | BF/DF | BF/1F1B | BF/Megatron |",
            "|---|---|---|---|---|---|---|---|---|"]
    for value, cl in clusters:
        for beta in betas:
            r = {m: best(model, cl, beta, m) for m in ("breadth_first", "depth_first", "1f1b", "megatron_like")}
            bf = r["breadth_first"]
            rows.append(f"| {value:g} | {beta:g} | {_fmt(bf)} | {_fmt(r['depth_first'])} | {_fmt(r['1f1b'])} | "
                        f"{_fmt(r['megatron_like'])} | {_ratio(bf, r['depth_first'])} | {_ratio(bf, r['1f1b'])} | "
                        f"{_ratio(bf, r['megatron_like'])} |")
    return "\n".join(rows)


def sensitivity(model: Model, cluster: Cluster, bandwidths, betas) -> str:
    return _sweep_table(model, "inter-node GB/s", [(bw, replace(cluster, inter_bw=bw * 1e9)) for bw in bandwidths],
                        betas)


def fixed_layout_sensitivity(model: Model, cluster: Cluster, bandwidths, betas) -> str:
    """BF ÷ Megatron-like when only the bandwidth changes: each keeps its best layout at the cluster's own
    bandwidth, or BF runs on Megatron-like's layout (same pp, tp, loops, micro-batches; FSDP instead of the
    distributed optimizer). Isolates the overlap of data-parallel traffic from the search's adaptation."""
    rows = ["| batch/GPU | layouts (chosen at %g GB/s): BF / Megatron-like | " % (cluster.inter_bw / 1e9)
            + " | ".join(f"{bw:g} GB/s" for bw in bandwidths) + " |", "|---" * (len(bandwidths) + 2) + "|"]
    for beta in betas:
        bf, mg = best(model, cluster, beta, "breadth_first"), best(model, cluster, beta, "megatron_like")
        if bf is None or mg is None:
            continue
        same = replace(mg.candidate, schedule="breadth_first", sharding="full")
        for label, cand in ((_layout(bf), bf.candidate), ("BF on Megatron-like's layout", same)):
            ratios = []
            for bw in bandwidths:
                cl = replace(cluster, inter_bw=bw * 1e9)
                a = simulate_candidate(model, cl, cand)
                b = simulate_candidate(model, cl, mg.candidate, MEGATRON).tokens_per_second_per_device
                fits = "" if a.peak_memory <= cl.usable_memory else " (does not fit)"
                ratios.append(f"{a.tokens_per_second_per_device / b:.2f}{fits}")
            rows.append(f"| {beta:g} | {label} / {_layout(mg)} | " + " | ".join(ratios) + " |")
    return "\n".join(rows)


def residency_table(model: Model, cluster: Cluster, betas=(0.5, 2)) -> str:
    """Without tensor parallel (a replica's weights over pp GPUs only) on 64 GPUs: where keeping every local
    stage gathered stops fitting, and which weight residency each schedule's best layout then uses."""
    small = replace(cluster, num_nodes=8)
    rows = ["| batch/GPU | schedule | model TFLOP/s per GPU | layout | residency |", "|---|---|---|---|---|"]
    for beta in betas:
        for name in ("breadth_first", "depth_first", "1f1b"):
            plans = search(model, small, int(beta * small.world_size), top=1, schedules=[name], shardings=["full"],
                           tensor_parallels=(1,), min_pipeline_parallel=2)
            if not plans:
                rows.append(f"| {beta:g} | {name} | — | does not fit | |")
                continue
            c = plans[0].candidate
            rows.append(f"| {beta:g} | {name} | "
                        f"{plans[0].tokens_per_second_per_device * model.flops_per_token() / 1e12:.1f} | "
                        f"{_layout(plans[0])} | {c.residency}{c.cache or ''} |")
    return "\n".join(rows)


# Context parallel, with and without: (label, model, nodes of the cluster, sequences per step)
CP_CASES = (("52B, seq 1024, 1/8 sequence per GPU", "gpt_52b", 64, 64),
            ("8B, seq 32768, 1/4 sequence per GPU (activation checkpointing)", "gpt_8b_32k", 8, 16))
CP_SIZES = (1, 2, 4, 8)


def context_parallel_table(cluster_name: str) -> str:
    """For each CP_CASES entry, the planner's best layout (every schedule, tp, sequence parallel, sharding) with
    context parallel off (cp = 1) and searched beside tp (CP_SIZES), its throughput and peak memory per GPU."""
    rows = ["| case | cp searched | model TFLOP/s per GPU | tokens/s per GPU | peak memory GB | layout |",
            "|---|---|---|---|---|---|"]
    for label, model_name, nodes, batch in CP_CASES:
        model, cluster = load(model_name, cluster_name)
        cluster = replace(cluster, num_nodes=nodes)
        for sizes in ((1,), CP_SIZES):
            plans = [p for p in search(model, cluster, batch, top=1, context_parallels=sizes,
                                       schedules=MODES["planner"][0], shardings=MODES["planner"][1]) if p.fits]
            searched = "no (cp = 1)" if sizes == (1,) else "cp ∈ {" + ", ".join(map(str, sizes)) + "}"
            if not plans:
                rows.append(f"| {label} ({cluster.world_size} GPUs) | {searched} | — | — | — | does not fit |")
                continue
            p = plans[0]
            tflops = p.tokens_per_second_per_device * model.flops_per_token() / 1e12
            rows.append(f"| {label} ({cluster.world_size} GPUs) | {searched} | {tflops:.1f} | "
                        f"{p.tokens_per_second_per_device:.0f} | {p.peak_memory / 1e9:.1f} | {_layout(p)} "
                        f"dp{p.candidate.data_parallel} |")
    return "\n".join(rows)


def gantt(model: Model, cluster: Cluster, plan, path: Path) -> None:
    from lightning_bfpp.sim.draw import draw_schedule

    c = plan.candidate
    result = simulate_candidate(model, cluster, c, timeline=True)
    draw_schedule(result, path, title=f"52B, {c.schedule} tp={c.tensor_parallel} pp={c.pipeline_parallel} "
                  f"loops={c.loops} m={c.micro_batches}x{c.micro_batch_size} dp={c.data_parallel} (simulated seconds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_52b")
    parser.add_argument("--cluster", default="a100_paper")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    parser.add_argument("--quick", action="store_true", help="fewer batch sizes, no sensitivity tables")
    parser.add_argument("--full", action="store_true", help="also activation checkpointing and achieved-compute tables")
    parser.add_argument("--residency", action="store_true",
                        help="only the tp=1 weight-residency table (64 GPUs, ~1 min)")
    parser.add_argument("--context-parallel", action="store_true",
                        help="only the table of the best layouts with and without context parallel (CP_CASES)")
    parser.add_argument("--cross-step", action="store_true",
                        help="only the cross-step overlap table (BF, BF-ZB; host time between steps 0-10 ms)")
    parser.add_argument("--shard-unit", action="store_true",
                        help="only the per-layer FSDP units table (BF-ZB at 1/8 sequence per GPU, ~1 min)")
    args = parser.parse_args()
    if args.residency:
        print(residency_table(*load(args.model, args.cluster)))
        return
    if args.context_parallel:
        start = time.perf_counter()
        print(context_parallel_table(args.cluster))
        print(f"({time.perf_counter() - start:.0f} s)")
        return
    if args.cross_step:
        print(cross_step_table(*load(args.model, args.cluster)))
        return
    if args.shard_unit:
        print(shard_unit_table(*load(args.model, args.cluster)))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, cluster = load(args.model, args.cluster)
    betas = BETAS[1:4] if args.quick else BETAS
    start = time.perf_counter()
    peak = float(yaml.safe_load((ROOT / "conf" / "cluster" / f"{args.cluster}.yaml").read_text())["peak_flops"])

    sections: list[tuple[str, str]] = []

    def add(title: str, body: str) -> None:
        sections.append((title, body))
        progress(f"section done: {title}", start)

    fpt = model.flops_per_token()
    results = sweep(model, cluster, betas)
    small = replace(cluster, num_nodes=8)
    results64 = sweep(model, small, betas)
    figure([(results64, f"{args.model}, {small.world_size} GPUs"),
            (results, f"{args.model}, {cluster.world_size} GPUs")],
           betas, out / "paper_reproduction_throughput.png", fpt, cluster.flops)
    add(f"{small.world_size} GPUs (no activation checkpointing)", tables(results64, betas, peak, fpt, cluster.flops))
    add(f"{cluster.world_size} GPUs (model as in conf/model, no activation checkpointing)",
        tables(results, betas, peak, fpt, cluster.flops))

    if args.full:
        ckpt = replace(model, checkpointing=True)
        results_ckpt = sweep(ckpt, cluster, betas)
        figure([(results_ckpt, f"{args.model} + activation checkpointing, {cluster.world_size} GPUs")], betas,
               out / "paper_reproduction_throughput_ckpt.png", fpt, cluster.flops)
        add("With activation checkpointing (backward = 3 x forward)",
            tables(results_ckpt, betas, peak, model.flops_per_token(), cluster.flops))
        add("Sensitivity to achieved compute (no checkpointing, 25 GB/s)",
            sensitivity_flops(model, cluster, peak, (0.3, 0.5, 0.7), (0.5, 1, 4)))
    if not args.quick:
        add("Sensitivity to inter-node bandwidth (no checkpointing)",
            sensitivity(model, cluster, (6.25, 12.5, 25, 50), (0.125, 0.5, 2)))
        add("Inter-node bandwidth with each method's layout held fixed",
            fixed_layout_sensitivity(model, cluster, (6.25, 12.5, 25, 50), (0.125, 0.5, 2)))
    add(f"FSDP units per layer (BF-ZB, 1/8 sequence per GPU, {cluster.world_size} GPUs)",
        shard_unit_table(model, cluster))
    bf1 = results.get((1, "breadth_first"))
    if bf1 not in (None, "n/a"):
        gantt(model, cluster, bf1, out / "paper_reproduction_bf_gantt.png")
    text = [f"<!-- generated by: python examples/paper_reproduction.py{' --quick' if args.quick else ''} "
            f"({time.perf_counter() - start:.0f} s) -->"]
    for title, body in sections:
        text += [f"### {title}", "", body, ""]
    (out / "paper_reproduction_tables.md").write_text("\n".join(text))
    print("\n".join(text))


def sensitivity_flops(model: Model, cluster: Cluster, peak: float, efficiencies, betas) -> str:
    clusters = [(eff, replace(cluster, flops=peak * eff)) for eff in efficiencies]
    return _sweep_table(model, "achieved fraction of 312 TFLOP/s", clusters, betas)


if __name__ == "__main__":
    main()
