"""One figure of the benchmark summary (benchmarks/results/summary.png): P1/FSDP ratios,
P2 bubble per schedule vs formula, P4 speedup, P5 per-rank memory and activations per schedule."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _bar(ax, labels, stats, goal=None, goal_label=""):
    meds = [s["median"] for s in stats]
    err = [[m - s["min"] for m, s in zip(meds, stats)], [s["max"] - m for m, s in zip(meds, stats)]]
    ax.bar(labels, meds, yerr=err, capsize=4, color="#4c72b0")
    if goal is not None:
        ax.axhline(goal, color="#c44e52", ls="--", label=goal_label)
        ax.legend(fontsize=8)


def plot(summary: dict, path: Path) -> None:
    d = summary.get("details", {})
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    ax = axes[0][0]
    if "p1_fsdp" in d:
        p1, fs = d["p1_fsdp"]["p1"], d["p1_fsdp"]["fsdp"]
        _bar(ax, ["P1 bfpp-in-Lightning\n/ raw torch (time)", "bfpp / Lightning FSDP2\n(throughput)"],
             [p1["ratio_period"], fs["throughput_ratio_bfpp_over_fsdp"]], 1.05, "P1 goal ≤ 1.05")
        ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_title("P1 overhead and FSDP comparison (median, min–max)")
    ax = axes[0][1]
    if "p2" in d:
        rows = d["p2"]["schedules"]
        labels = list(rows)
        x = range(len(labels))
        meds = [rows[k]["measured"]["median"] for k in labels]
        err = [[m - rows[k]["measured"]["min"] for m, k in zip(meds, labels)],
               [rows[k]["measured"]["max"] - m for m, k in zip(meds, labels)]]
        ax.bar([i - 0.2 for i in x], meds, 0.4, yerr=err, capsize=4, label="measured", color="#4c72b0")
        ax.bar([i + 0.2 for i in x], [rows[k]["theory"] for k in labels], 0.4, label="(pp−1)/(loops·m)",
               color="#dd8452")
        ax.set_xticks(list(x), labels)
        ax.legend(fontsize=8)
    ax.set_title("P2 bubble = idle / compute (pp=2, m=4)")
    ax = axes[1][0]
    if "p4" in d:
        _bar(ax, ["pp=2 bfpp vs 1 process"], [d["p4"]["speedup"]], 1.6, "goal ≥ 1.6")
        ax.axhline(2.0, color="grey", lw=0.8, ls=":")
    ax.set_title("P4 throughput speedup on 2 cores")
    ax = axes[1][1]
    if "p5" in d:
        p5 = d["p5"]
        names = sorted(p5["per_rank"])
        ax.bar(names, [p5["per_rank"][n]["state_bytes"] / 2**20 for n in names], color="#4c72b0",
               label="param + grad + AdamW state")
        ax.axhline(p5["expected_per_rank"]["state_bytes"] / 2**20, color="#c44e52", ls="--",
                   label="full model / (pp·dp)")
        ax.set_ylabel("MiB per rank")
        ax.legend(fontsize=8, loc="lower left")
    ax.set_title("P5 state memory with FSDP (pp=2 × dp=2)")
    ax = axes[1][2]
    if "p2" in d:
        rows = d["p2"]["schedules"]
        ax.bar(list(rows), [rows[k]["activation_peak_bytes"] / 2**20 for k in rows], color="#55a868")
        ax.set_ylabel("MiB (max over ranks)")
    if "p1_fsdp" in d:
        ax.axhline(d["p1_fsdp"]["fsdp"]["fsdp_memory"]["activation_bytes"] / 2**20, color="#c44e52", ls="--",
                   label="Lightning FSDP2 (dp=2)")
        ax.legend(fontsize=8)
    ax.set_title("P5 peak saved activations per schedule")
    ax = axes[0][2]
    ax.axis("off")
    lines = ["goal                         value   met"]
    for key, g in summary.get("goals", {}).items():
        value = "—" if g["value"] is None else f"{g['value']:.3f}"
        lines.append(f"{key:<25} {g['goal']:>7}  {value:>6}  "
                     f"{'' if g['met'] is None else ('yes' if g['met'] else 'NO')}")
    fs = summary.get("fsdp_comparison")
    if fs:
        lines += ["", "vs Lightning FSDP2 (dp=2), bfpp / FSDP:",
                  f"  throughput {fs['throughput_ratio_bfpp_over_fsdp']:.3f}",
                  f"  param+grad+optim bytes {fs['state_memory_ratio_bfpp_over_fsdp']:.3f}",
                  f"  saved activations {fs['activation_memory_ratio_bfpp_over_fsdp']:.3f}"]
    ax.text(0.0, 1.0, "\n".join(lines), family="monospace", fontsize=9, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
