"""Markdown tables of benchmarks/results/summary.json (pasted into BENCHMARKS.md).

    python benchmarks/report.py [benchmarks/results/summary.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common import ROOT, fmt

MiB = 2**20


def tables(s: dict) -> str:
    d, out = s.get("details", {}), []
    out.append("| goal | target | measured | met |\n|---|---|---|---|")
    for key, g in s.get("goals", {}).items():
        value = "—" if g["value"] is None else f"{g['value']:.3f}"
        out.append(f"| `{key}` | {g['goal']} | {value} | "
                   f"{'—' if g['met'] is None else ('yes' if g['met'] else '**no**')} |")
    if "p1_fsdp" in d:
        p1, fs = d["p1_fsdp"]["p1"], d["p1_fsdp"]["fsdp"]
        out.append("\n**P1 overhead** (per optimizer step; median over rounds of per-round medians, (min–max, n "
                   "rounds))\n")
        out.append("| quantity | bfpp in Lightning | raw torch loop | ratio |\n|---|---|---|---|")
        out.append(f"| period (batch start → next batch start) | {fmt(p1['bfpp_period_s'])} s | "
                   f"{fmt(p1['raw_period_s'])} s | {fmt(p1['ratio_period'])} |")
        out.append(f"| step (batch start → batch end) | {fmt(p1['bfpp_step_s'])} s | {fmt(p1['raw_step_s'])} s | "
                   f"{fmt(p1['ratio_step'])} |")
        out.append("\n**Comparison with Lightning's FSDP** (same 2 processes, same global batch)\n")
        out.append("| | bfpp (pp=2, loops=2, m=4) | Lightning FSDP2 (dp=2) | bfpp / FSDP |\n|---|---|---|---|")
        out.append(f"| step period | {fmt(d['p1_fsdp']['p1']['bfpp_period_s'])} s | {fmt(fs['fsdp_period_s'])} s | "
                   f"throughput {fmt(fs['throughput_ratio_bfpp_over_fsdp'])} |")
        bm, fm = fs["bfpp_memory"], fs["fsdp_memory"]
        out.append(f"| param + grad + AdamW bytes (max rank) | {bm['state_bytes'] / MiB:.2f} MiB | "
                   f"{fm['state_bytes'] / MiB:.2f} MiB | {fs['state_memory_ratio_bfpp_over_fsdp']:.3f} |")
        out.append(f"| peak saved activations (max rank) | {bm['activation_bytes'] / MiB:.2f} MiB | "
                   f"{fm['activation_bytes'] / MiB:.2f} MiB | {fs['activation_memory_ratio_bfpp_over_fsdp']:.3f} |")
    if "p2" in d:
        out.append("\n**P2 bubble** (idle / compute, max over ranks; per-round median of steps, then median (min–max) "
                   "over rounds)\n")
        out.append("| schedule | loops | formula | measured | abs error | each rank's bubble | busiest ÷ idlest rank's "
                   "compute | busy share of schedule span | peak saved activations | vs breadth_first: activations "
                   "| bubble | step |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, r in d["p2"]["schedules"].items():
            per_rank = " / ".join(f"{v['median']:.3f}" for v in r.get("bubble_per_rank", {}).values()) or "—"
            imbalance = f"{r['compute_max_over_min_rank']['median']:.3f}" if "compute_max_over_min_rank" in r else "—"
            out.append(f"| {name} | {r['loops']} | {r['theory']:.3f} | {fmt(r['measured'])} | {r['abs_error']:.3f} | "
                       f"{per_rank} | {imbalance} | {r['busy_fraction_of_step']['median']:.3f} | "
                       f"{r['activation_peak_bytes'] / MiB:.2f} MiB | {r['activation_vs_breadth_first']:.2f} | "
                       f"{r.get('bubble_vs_breadth_first', float('nan')):.2f} | "
                       f"{r.get('period_vs_breadth_first', float('nan')):.2f} |")
    if "p4" in d:
        p4 = d["p4"]
        out.append("\n**P4 scaling** (one process, one thread vs pp=2 with one thread per rank)\n")
        out.append("| | step period | samples/s |\n|---|---|---|")
        out.append(f"| 1 process | {fmt(p4['single_period_s'])} s | {p4['samples_per_s_single']:.2f} |")
        out.append(f"| bfpp pp=2 | {fmt(p4['bfpp_period_s'])} s | {p4['samples_per_s_bfpp']:.2f} |")
        out.append(f"| speedup | {fmt(p4['speedup'])} | |")
        if "speedup_auto" in p4:
            out.append(f"| bfpp pp=2, stage_layers=\"auto\" | {fmt(p4['bfpp_auto_period_s'])} s | "
                       f"{p4['setting']['batch'] / p4['bfpp_auto_period_s']['median']:.2f} |")
            out.append(f"| speedup, \"auto\" | {fmt(p4['speedup_auto'])} | |")
            out.append(f"| \"auto\" ÷ parameter cut (throughput) | {fmt(p4['auto_over_param_throughput'])} | |")
        b = p4.get("breakdown_s")
        if b:
            out.append(f"\npp=2 step breakdown (s): ideal (half the single step) {b['ideal_half_of_single']:.3f}; "
                       f"busy compute {b['compute']:.3f}; pipeline idle {b['pipeline_idle']:.3f}; "
                       f"outside the schedule (optimizer, Lightning) {b['outside_schedule']:.3f}")
    if "torch" in d:
        t = d["torch"]
        out.append(f"\n**bfpp vs torch's own schedule classes** (same stages and micro-batches, "
                   f"pp={t['setting']['pp']}, m={t['setting']['m']}; ratio per round = bfpp ÷ torch throughput, median "
                   "(min–max))\n")
        out.append("| torch class | bfpp schedule | loops | torch period | bfpp period | bfpp ÷ torch |\n"
                   "|---|---|---|---|---|---|")
        for cls, r in t["schedules"].items():
            out.append(f"| {cls} | {r['bfpp_schedule']} | {r['loops']} | {fmt(r['torch_period_s'])} s | "
                       f"{fmt(r['bfpp_period_s'])} s | {fmt(r['ratio'])} |")
    if "auto" in d:
        a = d["auto"]
        st = a["setting"]
        out.append(f"\n**layout=\"auto\" vs hand-set layouts** ({st['model']}, global batch {st['batch']}, "
                   f"{st['processes']} processes, {st['grid_size']} layouts{' (quick subset)' if st['quick'] else ''}, "
                   f"{st['rounds']} rounds; samples/s, median (min–max))\n")
        out.append(f"auto ÷ best hand-set layout ({a['best_hand_layout']}): **{fmt(a['ratio'])}**; auto ÷ the fastest "
                   f"layout of each round: {fmt(a['ratio_vs_round_max'])}"
                   + (f"; auto ÷ the layout best over the other rounds (held out): {fmt(a['ratio_held_out'])}"
                      if a.get("ratio_held_out") else "") + "; start-up (fit to first batch) auto "
                   f"{fmt(a['startup_s']['auto'], 2)} s, hand-set {fmt(a['startup_s']['hand'], 2)} s\n")
        picks = sorted({json.dumps(p, sort_keys=True) for p in a["auto_picks"]})
        out.append("auto's picks: " + "; ".join(f"`{p}`" for p in picks) + "\n")
        out.append("| layout | samples/s |\n|---|---|")
        for name, v in a["samples_per_s"].items():
            out.append(f"| {name} | {fmt(v, 2)} |")
    if "p5" in d:
        p5 = d["p5"]
        out.append(f"\n**P5 memory** (pp=2 × dp=2, sharding=full, {p5['model_params']:,} parameters; "
                   f"stage layers {p5['stage_layers']})\n")
        out.append("| rank | params | grads | AdamW state | total | total / (full / pp·dp) |\n"
                   "|---|---|---|---|---|---|")
        exp = p5["expected_per_rank"]
        for name, m in sorted(p5["per_rank"].items()):
            out.append(f"| {name} | {m['param_bytes'] / MiB:.3f} MiB | {m['grad_bytes'] / MiB:.3f} MiB | "
                       f"{m['optimizer_bytes'] / MiB:.3f} MiB | {m['state_bytes'] / MiB:.3f} MiB | "
                       f"{m['state_bytes'] / exp['state_bytes']:.4f} |")
        out.append(f"| full / (pp·dp) | {exp['param_bytes'] / MiB:.3f} MiB | {exp['grad_bytes'] / MiB:.3f} MiB | "
                   f"{exp['optimizer_bytes'] / MiB:.3f} MiB | {exp['state_bytes'] / MiB:.3f} MiB | 1 |")
        out.append(f"\nmax error {p5['max_error']:.4f}: partition (whole layers per stage) "
                   f"{p5['partition_error']:.4f}, FSDP shard padding {p5['fsdp_padding_error']:.4f}")
    if s.get("bench_seconds"):
        out.append(f"\nwall time per benchmark (s): {s['bench_seconds']}; total {s.get('elapsed_s')} s")
    return "\n".join(out)


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks" / "results" / "summary.json"
    print(tables(json.loads(path.read_text())))
