"""benchmarks/device.sh, the one prepared run for a lent GPU machine, in its --dry-run form (CPU, a tiny model):
every part runs and writes its numbers, so the script cannot rot between the rare runs on the device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from procenv import clean_env
from test_app import ROOT


@pytest.mark.slow
def test_device_script_dry_run_writes_every_part(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from device import BUDGET_S, DRY_BUDGET_S

    assert sum(BUDGET_S.values()) <= 8 * 60 - 30 and sum(DRY_BUDGET_S.values()) <= 2 * 60 - 5  # by construction
    out = tmp_path / "dry.json"
    # budgets x 4: this checks every code path runs, on a machine the rest of the suite loads (alone: ~90 s)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "device.sh"), "--dry-run", "--budget-scale", "4", "--out",
                           str(out), "--work", str(tmp_path / "work")], env=clean_env(PY=sys.executable), cwd=tmp_path,
                          capture_output=True, text=True, timeout=4 * sum(DRY_BUDGET_S.values()) + 120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and set(report["parts"]) == {"cpu", "gpu"}
    cpu, gpu = report["parts"]["cpu"], report["parts"]["gpu"]
    assert cpu["status"] == "ok" and gpu["status"] == "ok", (cpu["status"], gpu["status"])
    assert set(cpu["p2"]["schedules"]) == {"breadth_first", "depth_first", "gpipe", "1f1b", "breadth_first_zb"}
    assert cpu["p4_pp2"]["speedup"]["median"] > 0 and len(cpu["torch_schedules"]["schedules"]) == 4
    variants = gpu["variants"]
    assert {"fsdp2", "raw m=1", "raw m=8", "bfpp loops=1 m=1", "bfpp loops=4 m=8", "fsdp2 compiled", "raw m=1 compiled",
            "bfpp loops=1 m=1 compiled"} <= set(variants)
    for name, run in variants.items():
        assert run["step_s"] > 0 and run["tokens_per_s"] > 0, name
        if name.startswith("bfpp"):
            assert run["step_s_over_raw"] > 0 and run["step_s_over_fsdp2"] > 0 and run["simulated_step_s"] > 0, name
    assert set(gpu["layers"]) == {"8", "2", "1"}  # a layer table per micro-batch size (batch 8; m = 1, 4, 8)
    assert all([r["layer"] for r in rows] == ["embedding", "blocks.0", "blocks.1", "head"]
               for rows in gpu["layers"].values())
    assert "gpu:" in proc.stdout and "P2 breadth_first" in proc.stdout  # the short table


@pytest.mark.slow
def test_device_script_big_part_dry_run_names_the_cuda_graphs_setting_on_cpu(tmp_path):
    """The big part (issue 53: a compute-bound model, the plain loop and bfpp at m = 1, 4, 8, eager, compiled and
    with CUDA graphs) in its dry run: every eager and compiled variant runs, and cuda_graphs=True is refused on CPU
    naming the setting."""
    out = tmp_path / "big.json"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "device.sh"), "--dry-run", "--parts", "big",
                           "--budget-scale", "4", "--out", str(out), "--work", str(tmp_path / "work")],
                          env=clean_env(PY=sys.executable), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    big = json.loads(out.read_text())["parts"]["big"]
    assert big["status"] == "ok", big["status"]
    variants = big["variants"]
    for m in (1, 4, 8):
        for mode in ("eager", "compiled"):
            assert variants[f"raw m={m} {mode}"]["step_s"] > 0 and variants[f"bfpp m={m} {mode}"]["step_s_over_raw"] > 0
        assert "cuda_graphs=True (Hydra: schedule.cuda_graphs=true) needs a CUDA device" in \
            variants[f"bfpp m={m} cuda_graphs"]["refused_on_cpu"]


def test_timeline_on_cuda_times_with_events_not_launches(monkeypatch):
    """On a CUDA device the compute timeline records CUDA events (a kernel runs after its launch returns) and turns
    them into seconds once, at the step's end. Checked here with events whose times we set."""
    import torch

    from lightning_bfpp.runtime.instrument import Timeline

    class Event:  # torch.cuda.Event's interface: record, synchronize, elapsed_time (milliseconds)
        now = 0.0

        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.t, self.synced = None, False

        def record(self) -> None:
            self.t = Event.now

        def synchronize(self) -> None:
            self.synced = True

        def elapsed_time(self, other) -> float:
            return (other.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    timeline = Timeline(torch.device("cuda"))
    start = timeline.clock()
    for kind, t0, t1 in (("F", 1.0, 3.0), ("B", 5.0, 9.0)):  # the GPU ran 2 s of forward and 4 s of backward
        Event.now = t0
        a = timeline.clock()
        Event.now = t1
        timeline.events.append((kind, 0, 0, a, timeline.clock()))
    Event.now = 10.0
    end = timeline.clock()
    stats = timeline.stats(start, end)
    assert end.synced and stats["compute_s"] == 6.0 and stats["step_s"] == 10.0
    assert abs(stats["bubble_fraction"] - 4 / 6) < 1e-12
    assert all(isinstance(e[3], float) and e[4] - e[3] in (2.0, 4.0) for e in timeline.events)  # seconds, as on CPU


def test_a_part_past_its_budget_is_stopped_and_keeps_what_it_measured(tmp_path, monkeypatch):
    """The budget is what bounds the real run to 8 minutes: a part still running at its budget is killed with every
    process it started, and the report keeps its last complete write."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import device

    real = subprocess.Popen

    def part_that_overruns(cmd, **kwargs):  # in place of the part's process: writes once, then sleeps past its budget
        partial = cmd[cmd.index("--partial") + 1]
        code = (f"import sys, time; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import device, pathlib; "
                f"device._save(pathlib.Path({partial!r}), {{'first': 1}}); time.sleep(60)")
        return real([sys.executable, "-c", code], **kwargs)

    monkeypatch.setattr(device.subprocess, "Popen", part_that_overruns)
    result = device.run_part("cpu", True, 4, tmp_path)
    assert result["status"] == "stopped at budget (4 s)" and result["first"] == 1 and result["seconds"] < 15
