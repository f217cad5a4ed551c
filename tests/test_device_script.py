"""benchmarks/device.sh, the one prepared run for a lent GPU machine, in its --dry-run form (CPU, a tiny model):
every part runs and writes its numbers, so the script cannot rot between the rare runs on the device."""

from __future__ import annotations

import json
import subprocess
import sys

from procenv import clean_env
from test_app import ROOT


def test_device_script_dry_run_writes_every_part(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from device import BUDGET_S, DRY_BUDGET_S

    assert sum(BUDGET_S.values()) <= 8 * 60 - 30 and sum(DRY_BUDGET_S.values()) <= 2 * 60 - 5  # by construction
    out = tmp_path / "dry.json"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "device.sh"), "--dry-run", "--out", str(out), "--work",
                           str(tmp_path / "work")], env=clean_env(PY=sys.executable), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and set(report["parts"]) == {"cpu", "gpu"}
    cpu, gpu = report["parts"]["cpu"], report["parts"]["gpu"]
    # a part past its budget is stopped and keeps what it measured (a loaded machine may stop the CPU part early)
    assert cpu["status"] == "ok" or cpu["status"].startswith("stopped at budget"), cpu["status"]
    assert set(cpu["p2"]["schedules"]) == {"breadth_first", "depth_first", "gpipe", "1f1b"}
    assert cpu["seconds"] <= DRY_BUDGET_S["cpu"] + 5 and gpu["seconds"] <= DRY_BUDGET_S["gpu"] + 5
    assert gpu["status"] == "ok", gpu["status"]
    variants = gpu["variants"]
    assert {"fsdp2", "bfpp loops=1 m=1", "bfpp loops=4 m=8", "fsdp2 compiled", "bfpp loops=1 m=1 compiled"} <= set(variants)
    for name, run in variants.items():
        assert run["step_s"] > 0 and run["tokens_per_s"] > 0, name
        assert name.startswith("fsdp2") or (run["step_s_over_fsdp2"] > 0 and run["simulated_step_s"] > 0), name
    assert [r["layer"] for r in gpu["layers"]] == ["embedding", "blocks.0", "blocks.1", "head"]
    assert "gpu:" in proc.stdout and "P2 breadth_first" in proc.stdout  # the short table
