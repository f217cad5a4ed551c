"""A stop signal while training saves one checkpoint at the next step boundary on every rank (on_signal="save", the
default), the job exits with the signal's code, and a restart resumes from that checkpoint — as Lightning resumes it
(`ckpt_path="last"`, `"hpc"`, a SLURM requeue by itself) — to the weights of an uninterrupted run. A save that cannot
finish within its grace time is abandoned, and on_signal="exit" exits at once."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from exact_compare import assert_exact
from exact_model import reference
from launch import merged, run_lightning, run_slurm
from test_signals import BATCH, BUDGET_S, STOPPED, WORLD, signal_job

import lightning_bfpp.checkpoint as ckpt

MORE = 3  # steps the restarted run trains after the saved one


def trained_steps(work: Path) -> int:
    """The newest global step any rank finished before the job stopped (run_exact's pid_dir/stepR)."""
    return max(int(p.read_text()) for p in (work / "pids").glob("step*"))


def equals_reference(folder: Path, work: Path) -> int:
    """`folder` is a complete checkpoint holding the single-process weights of its step; returns that step."""
    assert ckpt.is_sharded(folder), sorted(p.name for p in folder.parent.iterdir())
    step = ckpt.read_meta(folder)["global_step"]
    state = ckpt.export(folder, work / "exported.pt")
    want, _ = reference(step, BATCH)
    assert_exact({k: state[k] for k in want}, want, "params")
    return step


def resumed_equals_reference(work: Path, step: int, result: list[list[dict]]) -> None:
    want, _ = reference(step + MORE, BATCH)
    params = merged(result[0])  # every rank's stages
    assert_exact({k: params[k] for k in want}, want, "params")


@pytest.mark.parametrize("resume", ["hpc", pytest.param("last", marks=pytest.mark.slow)])
def test_sigterm_saves_at_a_step_boundary_and_the_restart_resumes_exactly(tmp_path, resume):
    """SIGTERM to Lightning's launching process with no periodic checkpoint. Without a ModelCheckpoint the save is
    Lightning's HPC checkpoint in default_root_dir (ckpt_path="hpc"); with one (here every 1000 steps: none before
    the signal), `last.ckpt` in its folder (ckpt_path="last"). No step is lost, and the restart equals the
    uninterrupted run."""
    root, save_dir = tmp_path / "root", tmp_path / "ckpt"
    every = {"hpc": 0, "last": 1000}[resume]
    stopped = signal_job(tmp_path, "lightning", "launcher", signal.SIGTERM, save_every=every, root=str(root))
    assert stopped.codes == [128 + signal.SIGTERM] and stopped.gone_s < BUDGET_S, (
        stopped.codes, stopped.output[-4000:])
    said = STOPPED.findall(stopped.output)
    assert {int(r) for r, _ in said} == set(range(WORLD)), stopped.output[-4000:]
    assert all(why.startswith("rank 0 got SIGTERM (saved ") for _, why in said), said
    folder = root / "hpc_ckpt_1.ckpt" if resume == "hpc" else save_dir / "last.ckpt"
    step = equals_reference(folder, tmp_path)
    assert trained_steps(tmp_path) == step  # saved at the step every rank stopped at: nothing to redo
    cfg = {"pp": 2, "m": 2, "batch": BATCH, "steps": step + MORE, "resume": resume, "root": str(root),
           "save_every": every, "save_dir": str(save_dir)}
    resumed_equals_reference(tmp_path, step, run_lightning(tmp_path / "again", WORLD, [cfg]))


@pytest.mark.slow
def test_slurm_requeue_signal_saves_and_the_requeued_job_resumes_by_itself(tmp_path):
    """SLURM's requeue signal to every task: each saves at the same step (Lightning's hpc_ckpt_1.ckpt in the job's
    default_root_dir), exits 138, rank 0 requeues the job; the requeued job (the same command, no ckpt_path) resumes
    from it and equals the uninterrupted run."""
    root = tmp_path / "root"
    stopped = signal_job(tmp_path, "slurm", "all", signal.SIGUSR1, save_every=0, root=str(root))
    assert stopped.codes == [128 + signal.SIGUSR1] * WORLD, (stopped.codes, stopped.output[-4000:])
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    step = equals_reference(root / "hpc_ckpt_1.ckpt", tmp_path)
    assert trained_steps(tmp_path) == step
    cfg = {"pp": 2, "m": 2, "batch": BATCH, "steps": step + MORE, "root": str(root)}  # as the requeued job runs it
    resumed_equals_reference(tmp_path, step, run_slurm(tmp_path / "again", WORLD, [cfg]))


@pytest.mark.slow
def test_a_save_longer_than_its_grace_is_abandoned(tmp_path):
    """A 1 s grace against 2 s steps: the job exits with the signal's code, saying the save did not finish; the
    half-written save stays a hidden folder and the checkpoints before it are intact."""
    stopped = signal_job(tmp_path, "lightning", "child", signal.SIGTERM, settle=0.5, step_sleep=2.0, grace=1.0)
    assert stopped.codes == [128 + signal.SIGTERM] and stopped.gone_s < BUDGET_S, (
        stopped.codes, stopped.output[-4000:])
    said = STOPPED.findall(stopped.output)
    assert said and all("was not saved within the grace time" in why for _, why in said), said
    assert not (stopped.save_dir / "last.ckpt").exists()
    saved = sorted(stopped.save_dir.glob("step=*.ckpt"))
    assert saved, "no checkpoint was written before the signal"  # steps of 2 s, a checkpoint after each
    for folder in saved:
        equals_reference(folder, tmp_path)


@pytest.mark.slow
def test_on_signal_exit_stops_at_once_without_saving(tmp_path):
    stopped = signal_job(tmp_path, "lightning", "child", signal.SIGTERM, save_every=0, on_signal="exit",
                         root=str(tmp_path / "root"))
    assert stopped.codes == [128 + signal.SIGTERM] and stopped.gone_s < BUDGET_S, (
        stopped.codes, stopped.output[-4000:])
    assert {why for _, why in STOPPED.findall(stopped.output)} == {"rank 1 got SIGTERM"}
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())


@pytest.mark.slow
def test_app_resumes_by_itself_after_sigterm(tmp_path):
    """The app, as a user runs it: SIGTERM in the middle of a run with no periodic checkpoint, then the same command
    again (ckpt_path=auto, the default): it resumes from <run dir>/checkpoints/last.ckpt, saved at the signal, and
    ends where the uninterrupted run ends. One process: a one-process job saves on a signal too."""
    import re
    import subprocess
    import sys
    import threading
    import time

    from test_app import TRAIN, clean_env
    from test_cli_layouts import COMMON, ONE_PROCESS, _summary

    run_dir = tmp_path / "run"
    args = [str(TRAIN), *COMMON, *ONE_PROCESS, "trainer.max_steps=40", "trainer.val_check_interval=40",
            "trainer.enable_progress_bar=true", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    seen = bytearray()
    reader = threading.Thread(
        target=lambda: [seen.extend(chunk) for chunk in iter(lambda: proc.stdout.read1(4096), b"")], daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not re.search(rb"\| *(1\d|2\d)/40", bytes(seen)):  # the progress bar (every 10 steps) at 10 or 20
        assert proc.poll() is None and time.monotonic() < deadline, bytes(seen).decode(errors="replace")[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=BUDGET_S) == 128 + signal.SIGTERM, bytes(seen).decode(errors="replace")[-3000:]
    reader.join(timeout=10)
    step = ckpt.read_meta(run_dir / "checkpoints" / "last.ckpt")["global_step"]
    assert 10 <= step < 40, step
    again = subprocess.run([sys.executable, *args], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"ckpt_path=auto: resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in again.stderr + again.stdout
    whole = tmp_path / "whole"
    subprocess.run([sys.executable, *args[:-1], f"hydra.run.dir={whole}"], cwd=tmp_path, env=clean_env(),
                   check=True, capture_output=True, timeout=300)
    a, b = _summary(whole), _summary(run_dir)
    assert b["steps"] == 40 and abs(a["train_loss"] - b["train_loss"]) <= 1e-5 * a["train_loss"], (a, b)
    assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * a["val_loss"], (a, b)


@pytest.mark.slow
def test_app_resumes_on_another_world_size_with_layout_auto(tmp_path):
    """Elastic: a run on 2 processes stops at step 4; the same run directory restarted on 1 process with
    schedule.layout=auto picks its own layout, resumes by itself (ckpt_path=auto), and ends where an uninterrupted
    run of 8 steps ends: the same global batch (data.batch_size) in the same order, whatever the data parallelism."""
    from test_app import run_cli
    from test_cli_layouts import COMMON, _summary

    auto = [*COMMON, "schedule.layout=auto", "data.batch_size=8", "trainer.val_check_interval=8"]
    run_dir, whole = tmp_path / "run", tmp_path / "whole"
    run_cli([*auto, "cluster=cpu_2", "trainer.max_steps=4", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    again = run_cli([*auto, "cluster=cpu_1", "trainer.max_steps=8", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert f"ckpt_path=auto: resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in again.stdout + again.stderr
    run_cli([*auto, "cluster=cpu_1", "trainer.max_steps=8", f"hydra.run.dir={whole}"], cwd=tmp_path)
    a, b = _summary(whole), _summary(run_dir)
    assert b["steps"] == 8 and b["world_size"] == 1
    assert abs(a["train_loss"] - b["train_loss"]) <= 1e-5 * a["train_loss"], (a, b)
    assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * a["val_loss"], (a, b)
