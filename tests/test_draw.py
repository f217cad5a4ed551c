"""Gantt picture: the library call writes a PNG; the CLI rejects illegal schedules with the message."""
import subprocess
import sys
from pathlib import Path

from lightning_bfpp.schedule import ScheduleSpec
from lightning_bfpp.sim.draw import draw_schedule

ROOT = Path(__file__).resolve().parents[1]


def test_draw_writes_png(tmp_path):
    path = draw_schedule(ScheduleSpec("breadth_first", pipeline_parallel=2, loops=2, micro_batches=4),
                         tmp_path / "bf.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_cli_illegal_combo_exits_nonzero(tmp_path):
    out = tmp_path / "x.png"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "draw_schedule.py"), "schedule=depth_first",
         "schedule.pipeline_parallel=4", "schedule.loops=2", "schedule.micro_batches=6", f"out={out}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode != 0
    assert "micro_batches (6) divisible by pipeline_parallel (4)" in proc.stderr
    assert not out.exists()
    assert not any(tmp_path.iterdir())  # Hydra leaves no outputs/ or .hydra/ behind


def test_draw_from_timeline(tmp_path):
    from lightning_bfpp.schedule import build_schedule
    from lightning_bfpp.sim import simulate, unit_costs

    result = simulate(build_schedule(ScheduleSpec("1f1b", pipeline_parallel=2, loops=1, micro_batches=4)),
                      unit_costs(2, 2, unshard=0.3, reduce=0.3))
    assert draw_schedule(result.timeline, tmp_path / "t.png").stat().st_size > 5000
    assert draw_schedule(result, tmp_path / "r.png").stat().st_size > 5000


def _cli(tmp_path, *args):
    return subprocess.run([sys.executable, str(ROOT / "examples" / "draw_schedule.py"), *args],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_cli_names_settings_it_would_truncate_or_ignore(tmp_path):
    proc = _cli(tmp_path, "schedule.micro_batches=2.5", f"out={tmp_path / 'x.png'}")
    assert proc.returncode == 2 and "schedule.micro_batches=2.5 must be an integer" in proc.stderr
    proc = _cli(tmp_path, "costs=model", "data_parallel=1000", f"out={tmp_path / 'x.png'}")
    assert proc.returncode == 2 and "do not fit cluster=cpu_2 (2 devices)" in proc.stderr
    # costs=model draws tensor parallel's cost: tp=2 is another picture than tp=1
    pictures = []
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.png"
        assert _cli(tmp_path, "costs=model", "cluster=gpu_8", f"schedule.tensor_parallel={tp}",
                    f"out={out}").returncode == 0
        pictures.append(out.read_bytes())
    assert pictures[0] != pictures[1]
