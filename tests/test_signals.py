"""SIGTERM / SIGINT to the launching process or to a child rank, under Lightning's launcher and torchrun: every
process is gone within seconds, the job exits with the signal's code (128 + N), every rank names the rank that
got the signal, and the newest checkpoint folder is complete and holds the reference weights of its step. With
on_signal="save" (the default) every rank first saves last.ckpt at one step boundary (tests/test_preemption.py: what
resumes it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from exact_compare import assert_exact
from exact_model import reference
from launch import start_lightning, start_slurm, start_torchrun

import lightning_bfpp.checkpoint as ckpt
from lightning_bfpp.job.liveness import pid_alive

WORLD = 2
BATCH = 16
BUDGET_S = 30  # the promise: every process gone within this many seconds of the signal
STOPPED = re.compile(r"\[rank (\d+)\] bfpp: the job stops because (.*)")


@dataclass
class Stopped:
    """What a signalled job did: seconds from the signal until every process was gone, exit status, output."""

    gone_s: float
    codes: list[int]  # of the processes the user started (the launcher, torchrun, or every SLURM task)
    output: str
    save_dir: Path


def signal_job(work: Path, launcher: str, target: str, signum: int, settle: float = 1.0, **cfg_extra) -> Stopped:
    """Train StackNet (pp=2, a checkpoint every step) on WORLD processes under `launcher` ("lightning", "torchrun",
    or "slurm": one process per rank with SLURM's variables), send `signum` to `target` ("launcher": the process the
    user started, rank 0 under SLURM; "child": rank 1; "all": every rank, as SLURM's --signal does) once every rank
    trains, and wait until every process is gone (at most BUDGET_S + 30 s). `cfg_extra`: tests/run_exact.py keys."""
    pid_dir, save_dir = work / "pids", work / "ckpt"
    pid_dir.mkdir(parents=True)
    cfg = [{"pp": 2, "loops": 1, "m": 2, "batch": BATCH, "steps": 100000, "step_sleep": 0.2, "pid_dir": str(pid_dir),
            "save_every": 1, "save_dir": str(save_dir), "timeout": 300, "root": str(work / "root"), **cfg_extra}]
    procs = _start(work, launcher, cfg)
    outputs: list[str] = [""] * len(procs)
    readers = [threading.Thread(target=lambda i=i, p=p: outputs.__setitem__(i, p.communicate()[0]), daemon=True)
               for i, p in enumerate(procs)]
    for reader in readers:
        reader.start()  # drain the pipes: a full pipe would block the ranks
    pids: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 180
        while True:  # until every rank has written its pid
            found = {int(p.name[4:]): p.read_text() for p in pid_dir.glob("rank*")}
            if len(found) >= WORLD and all(found.values()):
                break
            running = all(p.poll() is None for p in procs)
            assert running and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.1)
        pids = {r: int(p) for r, p in found.items()} | ({-1: procs[0].pid} if len(procs) == 1 else {})
        time.sleep(settle)  # well inside training (and checkpointing)
        victims = {"launcher": [procs[0].pid], "child": [pids[1]], "all": [pids[r] for r in range(WORLD)]}[target]
        for pid in victims:
            os.kill(pid, signum)
        sent, asked = time.monotonic(), False
        while any(pid_alive(p) for p in pids.values()) and time.monotonic() - sent < BUDGET_S + 30:
            if not asked and time.monotonic() - sent > BUDGET_S - 10:  # before torchrun's own SIGKILL at 30 s
                asked = _dump_stacks(pids)  # a rank about to miss the budget prints where it is (tests/run_exact.py)
            time.sleep(0.05)
        gone = time.monotonic() - sent
    finally:
        for p in procs:  # nothing is left behind, even when the test fails
            p.kill()
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    for reader in readers:
        reader.join(timeout=30)
    return Stopped(gone, [p.wait() for p in procs], "\n".join(outputs), save_dir)


def _dump_stacks(pids: dict[int, int]) -> bool:
    for rank, pid in pids.items():
        if rank >= 0 and pid_alive(pid):
            os.kill(pid, signal.SIGUSR2)
    return True


def _start(work: Path, launcher: str, cfg: list[dict]) -> list[subprocess.Popen]:
    """The job's processes: the launcher's, torchrun's, or one per rank with SLURM's variables (SLURM_JOB_ID 4242 and
    a fake `scontrol` that appends its arguments to work/scontrol.log)."""
    if launcher == "lightning":
        return [start_lightning(work / "out", WORLD, cfg)]
    if launcher == "torchrun":
        return [start_torchrun(work / "out", WORLD, cfg)]
    fake_bin = work / "bin"  # a `scontrol` that records what it was asked
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {work / "scontrol.log"}\n')
    (fake_bin / "scontrol").chmod(0o755)
    return start_slurm(work / "out", WORLD, cfg, PATH=f"{fake_bin}:{os.environ['PATH']}")


def newest_checkpoint_is_complete(save_dir: Path, work: Path, name: str | None = None) -> int:
    """Every visible checkpoint folder is complete; the newest (or `name`) holds the reference weights of its step."""
    saved = {int(p.name[5:-5]): p for p in save_dir.glob("step=*.ckpt")}
    assert saved, "no checkpoint was written before the signal"
    assert all(ckpt.is_sharded(p) for p in saved.values()), sorted(p.name for p in saved.values())
    step = max(saved)
    if name is not None:
        assert ckpt.is_sharded(save_dir / name), sorted(p.name for p in save_dir.iterdir())
        step = ckpt.read_meta(save_dir / name)["global_step"]
        saved[step] = save_dir / name
    state = ckpt.export(saved[step], work / "exported.pt")
    want, _ = reference(step, BATCH)  # (one epoch: 16 steps; the signal comes after about 6)
    assert_exact({k: state[k] for k in want}, want, "params")
    return step


CASES = [("lightning", "launcher", signal.SIGTERM), ("lightning", "child", signal.SIGTERM),
         ("lightning", "launcher", signal.SIGINT), ("lightning", "child", signal.SIGINT),
         ("torchrun", "launcher", signal.SIGTERM), ("torchrun", "child", signal.SIGTERM),
         ("torchrun", "launcher", signal.SIGINT), ("torchrun", "child", signal.SIGINT)]


FAST = {("lightning", "child", signal.SIGTERM), ("torchrun", "launcher", signal.SIGINT)}


@pytest.mark.parametrize("launcher,target,signum", [c if c in FAST else pytest.param(*c, marks=pytest.mark.slow)
                                                    for c in CASES], ids=[f"{j}-{t}-{s.name}" for j, t, s in CASES])
def test_signal_stops_every_process(tmp_path, launcher, target, signum):
    stopped = signal_job(tmp_path, launcher, target, signum)
    assert stopped.gone_s < BUDGET_S, (stopped.gone_s, stopped.output[-4000:])
    # Lightning's launcher: the job's code is the signal's, whichever rank got it; torchrun exits 1 for any worker's
    # stop
    assert stopped.codes == [128 + signum if launcher == "lightning" else 1], (stopped.codes, stopped.output[-4000:])
    said = STOPPED.findall(stopped.output)
    assert {int(r) for r, _ in said} == set(range(WORLD)), stopped.output[-4000:]  # every rank says why
    reasons = {why for _, why in said}
    assert len(reasons) == 1, reasons  # one reason, on every rank
    # Lightning's launching process is rank 0; torchrun passes its own signal on to every worker: one is named
    got = rf"rank \d got {signum.name}" if (launcher, target) == ("torchrun", "launcher") else \
        f"rank {int(target == 'child')} got {signum.name}"
    # on_signal="save" (the default): every rank saved last.ckpt (the ModelCheckpoint's folder) at one step first
    last = re.escape(str(stopped.save_dir / "last.ckpt"))
    saved = re.fullmatch(got + rf" \(saved {last} at step (\d+)\)", reasons.pop())
    assert saved, said
    # every rank said why before any rank could end (the launcher may kill the others as soon as one exits): rank 0
    # reports the save only after every rank has said it (a torchrun job once lost rank 0's line this way)
    last_said = max(m.end() for m in STOPPED.finditer(stopped.output))
    assert stopped.output.find("bfpp: saved ", last_said) > 0, stopped.output[-4000:]
    assert newest_checkpoint_is_complete(stopped.save_dir, tmp_path, "last.ckpt") == int(saved[1])
    newest_checkpoint_is_complete(stopped.save_dir, tmp_path)


@pytest.mark.slow
def test_killed_child_gives_the_failure_code(tmp_path):
    """A child's failure (here SIGKILL) ends the job with 1 on the launching process, not with Lightning's 137."""
    stopped = signal_job(tmp_path, "lightning", "child", signal.SIGKILL)
    assert stopped.gone_s < BUDGET_S and stopped.codes == [1], (stopped.gone_s, stopped.codes, stopped.output[-4000:])
    said = STOPPED.findall(stopped.output)
    assert said and all(why.startswith("rank 1 (pid ") for _, why in said), said


def test_slurm_requeue_signal_stops_every_rank_and_requeues(tmp_path):
    """SLURM's requeue signal (SIGUSR1, e.g. `#SBATCH --signal=USR1@90`, sent to every task), on_signal="exit": every
    rank stops at once with 138, rank 0 runs `scontrol requeue <job>`, and the newest checkpoint is complete (the
    requeued job resumes from it)."""
    stopped = signal_job(tmp_path, "slurm", "all", signal.SIGUSR1, on_signal="exit")  # saving: tests/test_preemption.py
    assert stopped.gone_s < BUDGET_S and stopped.codes == [128 + signal.SIGUSR1] * WORLD, (
        stopped.codes, stopped.output[-4000:])
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    said = STOPPED.findall(stopped.output)
    # every task got the signal: a rank may name itself when it stops before reading another's post
    assert {int(r) for r, _ in said} == set(range(WORLD)), said
    assert all(re.fullmatch(r"rank \d got SIGUSR1", why) for _, why in said), said
    newest_checkpoint_is_complete(stopped.save_dir, tmp_path)
