# Planner: its pick beats every fixed schedule's best, respects memory, and prints train.py overrides.
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_bfpp.schedule import SCHEDULES
from lightning_bfpp.sim import Cluster, Model
from lightning_bfpp.sim.planner import candidate_costs, candidates, memory_lower_bound, search, simulate_candidate

ROOT = Path(__file__).resolve().parents[1]


def _load(model: str, cluster: str, **override):
    m = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    c = yaml.safe_load((ROOT / "conf" / "cluster" / f"{cluster}.yaml").read_text())
    return Model.from_dict({**m, **override}), Cluster.from_dict(c)


PAIRS = [
    (("gpt_tiny", "cpu_4"), {}, 16),
    (("gpt_small", "gpu_8"), {}, 64),
    (("gpt_52b", "slurm_gpu_64"), {"n_layer": 16, "activation_checkpointing": True}, 128),  # a 13B cut of it
]


@pytest.mark.parametrize("names,override,batch", PAIRS, ids=[p[0][0] + "-" + p[0][1] for p in PAIRS])
def test_pick_never_worse_than_fixed_schedule(names, override, batch):
    model, cluster = _load(*names, **override)
    plans = search(model, cluster, batch, top=1, max_micro_batches=32)
    assert plans and plans[0].fits and plans[0].peak_memory <= cluster.device_memory
    best = plans[0].tokens_per_second_per_device
    for name in SCHEDULES:
        fixed = search(model, cluster, batch, top=0, schedules=[name], max_micro_batches=32)
        if fixed:
            assert best >= fixed[0].tokens_per_second_per_device * (1 - 1e-12), name
    assert plans[0].bubble is not None and plans[0].exposed_comm is not None


def test_memory_filter_and_lower_bound():
    model, cluster = _load("gpt_small", "gpu_8")
    assert cluster.memory_reserve == 3e9  # a GPU cluster keeps a few GB for the CUDA context and comm buffers
    tight = Cluster(**{**cluster.__dict__, "device_memory": 4e7 + cluster.memory_reserve})
    plans = search(model, tight, 64, top=0, include_unfit=True, max_micro_batches=16)
    assert any(not p.fits for p in plans) and any(p.fits for p in plans)
    assert all(p.peak_memory <= 4e7 for p in plans if p.fits)
    assert any(p.peak_memory > 4e7 and p.peak_memory < tight.device_memory for p in plans)  # the reserve rejects these
    for c in list(candidates(model, cluster, 64, max_micro_batches=16))[::5]:
        assert memory_lower_bound(c, candidate_costs(model, cluster, c)) <= simulate_candidate(model, cluster, c).peak_memory


def test_overrides_format():
    model, cluster = _load("gpt_tiny", "cpu_2")
    plan = search(model, cluster, 8, top=1)[0]
    over = plan.candidate.overrides(cluster="cpu_2", batch_size=8)
    assert over[0] == f"schedule={plan.candidate.schedule}"
    assert f"schedule.pipeline_parallel={plan.candidate.pipeline_parallel}" in over
    assert any(o.startswith("schedule.reshard_after_forward=") and o.endswith(("true", "false")) for o in over)
    assert over[-2:] == ["cluster=cpu_2", "data.batch_size=8"]


def test_plan_cli_writes_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plan.py"), "model=gpt_tiny", "cluster=cpu_2", "data.batch_size=8",
         "plan.top=3"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "best layout for examples/train.py:" in proc.stdout and "cluster=cpu_2 data.batch_size=8" in proc.stdout
    (out,) = tmp_path.glob("outputs/plan/*/*/plan.json")  # its own run directory, nothing else in the cwd
    data = json.loads(out.read_text())
    assert data["plans"] and data["best_overrides"][0].startswith("schedule=")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"] and f"{out.relative_to(tmp_path)}" in proc.stdout
