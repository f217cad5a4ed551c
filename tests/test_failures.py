"""A failing rank takes the whole job down, loudly and quickly, and every rank says which rank failed.
A non-finite loss stops every rank at the same step (or is skipped), never corrupting weights or checkpoints."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from exact_compare import assert_exact
from exact_model import reference
from launch import SCRIPT, clean_env, merged, run_lightning, run_torchrun, start_lightning

import lightning_bfpp.checkpoint as ckpt
from lightning_bfpp.job.guard import STARTUP_TIMEOUT
from lightning_bfpp.job.liveness import pid_alive

WORLD = 4
BUDGET_S = 60  # the promise: every process gone within this many seconds of the failure


def _names_the_failed_rank(output: str, failed: int) -> None:
    """Ranks say which rank failed, and none blames another. (Lightning's launcher may SIGKILL a rank before
    it has spoken: it stops every process within 5 s of a child's death, so not every rank always speaks.)"""
    said = re.findall(r"\[rank (\d)\] bfpp: the job stops because (.*)", output)
    assert all(re.search(rf"\brank {failed}\b", why) for _, why in said), said
    # Lightning's own observer (in rank 0) names a dead child too, when it stops everyone before any rank spoke
    observer = re.search(rf"\[rank: {failed}\] Child process with PID \d+ terminated", output)
    assert {int(r) for r, _ in said} - {failed} or observer, said


def _each_rank_says_it_once(output: str) -> None:
    said = re.findall(r"\[rank (\d)\] bfpp: the job stops because", output)
    assert len(said) == len(set(said)), f"a rank said why more than once: {said}"


def _wait_for_pids(pid_dir: Path, proc, timeout: float = 120) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = {int(p.name[4:]): p for p in pid_dir.glob("rank*")}
        if len(files) == WORLD and all(f.read_text() for f in files.values()):
            return {r: int(f.read_text()) for r, f in files.items()}
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    raise AssertionError("the ranks did not start training in time")


@pytest.mark.slow
@pytest.mark.parametrize("victim", [2, 0])
def test_killed_rank_takes_the_job_down(tmp_path, victim):
    """SIGKILL one rank mid-training (rank 0 is Lightning's launching process, its children become orphans)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    cfg = {"pp": 2, "loops": 2, "m": 2, "steps": 5000, "step_sleep": 0.02, "pid_dir": str(pid_dir)}
    proc = start_lightning(tmp_path / "out", WORLD, [cfg])
    pids = _wait_for_pids(pid_dir, proc)
    os.kill(pids[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    output = proc.communicate(timeout=BUDGET_S + 30)[0]  # ends when every rank has closed the shared pipe
    while any(pid_alive(p) for p in pids.values()) and time.monotonic() - killed_at < BUDGET_S:
        time.sleep(0.2)
    elapsed = time.monotonic() - killed_at
    assert not [r for r, p in pids.items() if pid_alive(p)] and elapsed < BUDGET_S, elapsed
    assert proc.returncode != 0
    _names_the_failed_rank(output, victim)
    _each_rank_says_it_once(output)


@pytest.mark.parametrize("fail_rank", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_failing_rank_stops_every_process(tmp_path, fail_rank):
    pids = tmp_path / "pids"
    pids.mkdir()
    with pytest.raises(AssertionError, match=f"injected failure on rank {fail_rank}") as failure:
        run_lightning(tmp_path, WORLD, [{"pp": 2, "loops": 2, "m": 2, "fail_rank": fail_rank, "pid_dir": str(pids)}],
                      timeout=100)
    # timed from the failure (the failing rank's on_exception writes that file), not from the launch,
    # which load stretches
    assert time.time() - (pids / f"exception{fail_rank}").stat().st_mtime < BUDGET_S
    _names_the_failed_rank(str(failure.value), fail_rank)
    _each_rank_says_it_once(str(failure.value).split("--- tail:")[0])  # the error lines of the output, each once
    assert f"[rank {fail_rank}] bfpp: the job stops because rank {fail_rank} failed: RuntimeError" in str(failure.value)


def test_a_rank_says_why_the_job_stops_once(capfd):
    """The failing rank's main thread says it (watchdog.report), then its watching thread sees the same first post once
    a peer exits: one line per rank (it was two on a failing rank 0)."""
    from lightning_bfpp.job.ending import say_stop

    for _ in range(2):
        say_stop(7, "rank 7 failed: RuntimeError: boom")
    say_stop(7, "rank 3 got SIGTERM")  # another reason is news
    assert capfd.readouterr().err.splitlines() == [
        "[rank 7] bfpp: the job stops because rank 7 failed: RuntimeError: boom",
        "[rank 7] bfpp: the job stops because rank 3 got SIGTERM"]


def test_a_taken_rendezvous_port_ends_every_process(tmp_path):
    """Two jobs on one machine with the same MASTER_PORT: the launching process cannot host the job's store, says
    which setting to change, and takes its child ranks down (they had waited for that store for 30 minutes)."""
    with socket.socket() as other_job:  # the other job's store, listening on the port
        other_job.bind(("127.0.0.1", 0))
        other_job.listen()
        port = other_job.getsockname()[1]
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), "2", '[{"pp": 2, "loops": 1, "m": 2}]'],
                                env=clean_env(MASTER_PORT=str(port)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        output = proc.communicate(timeout=120)[0]  # ends when every rank has closed the shared pipe
    assert proc.returncode != 0
    assert f"The job's rendezvous port (MASTER_PORT={port}) is taken by another process" in output, output[-3000:]


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def test_a_killed_launching_process_ends_the_ranks_still_joining(tmp_path):
    """Lightning's launching process SIGKILLed (out of memory, kill -9) while its child rank is still starting: the
    child says why and exits at once, rather than waiting out the rendezvous' 5 minutes for a store that is gone."""
    proc = start_lightning(tmp_path, 2, [{"pp": 2, "loops": 1, "m": 2}])
    deadline = time.monotonic() + 180  # the launching process' own imports first (a minute or more under load)
    while not (child := _children(proc.pid)):  # rank 1 started (it imports for seconds before it joins)
        assert proc.poll() is None and time.monotonic() < deadline, "the launching process started no child"
        time.sleep(0.05)
    proc.kill()
    killed = time.monotonic()
    bound = 0.8 * STARTUP_TIMEOUT.total_seconds()  # well before the rendezvous would give up; the child's imports
    try:                                           # take seconds idle, a minute or more on a loaded machine
        output = proc.communicate(timeout=bound)[0]  # until rank 1, which shares the pipe, is gone too
        gone_s = time.monotonic() - killed
    finally:
        for pid in child:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert "[rank 1] bfpp: the job stops because the launching process (rank 0, pid " in output, output[-3000:]
    assert gone_s < bound, gone_s  # 4.4 s measured (under load)


@pytest.mark.slow
def test_stuck_rank_ends_the_job_by_the_timeout(tmp_path):
    """A rank that is alive but stuck: the others' waits time out (timeout=10 s), and the stuck one is stopped too."""
    pids = tmp_path / "pids"
    pids.mkdir()
    with pytest.raises(AssertionError, match="launch failed") as failure:
        run_lightning(tmp_path, WORLD, [{"pp": 2, "loops": 2, "m": 2, "hang_rank": 3, "timeout": 10,
                                         "pid_dir": str(pids)}], timeout=100)
    # timed from when training was under way (rank 0's step 2 began; rank 3 hangs there), not from the launch, whose
    # start-up time load stretches: the timeout (10 s), the watchdog's grace (5 s), teardown and exit
    # (without the 10 s timeout, the job would wait the 120 s default and run_lightning's 100 s would fire first)
    assert time.time() - (pids / "rank0").stat().st_mtime < 10 + 5 + 30
    said = re.findall(r"\[rank (\d)\] bfpp: the job stops because (.*)", str(failure.value))
    # the first wait to end is a timeout; a rank waiting on a peer that has already stopped for it may instead see
    # the connection close (seen under the load of parallel test processes): either way the stuck rank is named
    assert said and all(re.search(r"timed? ?out|connection closed", why.lower())
                        and "rank 3 did not reach step 1" in why for _, why in said), said


@pytest.mark.slow
def test_a_rank_that_starts_later_than_the_timeout_still_joins(tmp_path):
    """`timeout` bounds the waits of a running job; the rendezvous waits for every process to start (at least
    STARTUP_TIMEOUT): a rank starting 15 s late with timeout=10 trains (it failed: 'waiting for clients' under load)."""
    start = time.monotonic()
    ranks = run_lightning(tmp_path, 2, [{"pp": 2, "loops": 1, "m": 2, "timeout": 10, "late_rank": 1, "late_s": 15}],
                          timeout=120)
    assert time.monotonic() - start > 15 and len(ranks[0]) == 2 and ranks[0][0]["losses"] == ranks[0][1]["losses"]


@pytest.mark.slow
def test_failing_rank_under_torchrun(tmp_path):
    with pytest.raises(AssertionError, match="injected failure on rank 1") as failure:
        run_torchrun(tmp_path, 2, [{"pp": 2, "loops": 1, "m": 2, "fail_rank": 1}], timeout=100)
    _names_the_failed_rank(str(failure.value), 1)


@pytest.mark.slow
def test_input_the_stages_cannot_take_names_the_stage(tmp_path):
    """A batch the first stage's layers cannot take fails with the layer, stage and pipeline rank named, on
    every rank."""
    with pytest.raises(AssertionError) as failure:
        run_lightning(tmp_path, 2, [{"pp": 2, "loops": 1, "m": 2, "wide_batch": 1}], timeout=100)
    output = str(failure.value)
    assert "mat1 and mat2 shapes cannot be multiplied" in output
    assert "bfpp: in layer embed of stage 0 (pipeline rank 0; layers embed, blocks.0, blocks.1, blocks.2)" in output
    assert "stage input float64[8, 17]" in output  # the micro-batch as it arrived (run_exact: 64-true)
    _names_the_failed_rank(output, 0)


@pytest.mark.slow
@pytest.mark.parametrize("step", [0, 2])
def test_ranks_of_a_replica_with_different_batches_stop_the_job(tmp_path, step):
    """Rank 1 (pipeline stage 1: it computes the loss) loads another batch than rank 0 (stage 0: it feeds the
    pipeline): the job stops at that step on every rank, saying so, instead of pairing one draw's inputs with another's
    targets. Checked on the first step and on measured steps (every step here)."""
    with pytest.raises(AssertionError) as failure:
        run_lightning(tmp_path, 2, [{"pp": 2, "loops": 1, "m": 2, "own_batch": step}], timeout=100)
    output = str(failure.value)
    assert "the training batch differs between ranks that must load the same one (rank 1 vs rank 0)" in output
    assert set(re.findall(r"\[rank (\d)\] bfpp: the job stops because rank \d failed: RuntimeError: bfpp: the training "
                          r"batch differs", output)) == {"0", "1"}


@pytest.mark.slow
def test_nonfinite_loss_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    nan_step = 3
    cfg = {"pp": 2, "loops": 2, "m": 2, "steps": 6, "nan_batch": nan_step, "pid_dir": str(tmp_path),
           "save_every": 1, "save_dir": str(tmp_path / "ckpt")}
    with pytest.raises(AssertionError, match=f"train_loss=nan at global step {nan_step}"):
        run_lightning(tmp_path / "out", WORLD, [cfg], timeout=120)
    for r in range(WORLD):  # every rank stopped in the same step, with the same error
        step, error = (tmp_path / f"exception{r}").read_text().split(" ", 1)
        assert int(step) == nan_step and error.startswith("FloatingPointError: train_loss=nan"), (r, step, error)
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == [f"step={s}.ckpt" for s in range(1, nan_step + 1)], saved  # nothing half-written
    state = ckpt.export(tmp_path / "ckpt" / f"step={nan_step}.ckpt", tmp_path / "last.ckpt")
    want, _ = reference(nan_step, 16)
    assert_exact({k: state[k] for k in want}, want, "params")


@pytest.mark.slow
def test_nonfinite_loss_skip_drops_that_batch(tmp_path):
    """nonfinite_loss='skip': the NaN batch's gradients are dropped on every rank; training goes on exactly."""
    cfg = {"pp": 2, "loops": 2, "m": 2, "steps": 4, "nan_batch": 1, "nonfinite": "skip"}
    ranks = run_lightning(tmp_path, WORLD, [cfg], timeout=120)[0]
    want, losses = reference(4, 16, skip_batches=frozenset({1}))  # the second batch gives no update
    got = merged(ranks)
    assert_exact({k: got[k] for k in want}, want, "params")
    assert all(torch.isnan(torch.tensor(r["losses"][1])) for r in ranks)
    assert all(r["skipped"][:2] == [None, 1.0] for r in ranks), [r["skipped"] for r in ranks]  # logged on the skip
    assert_exact([r["losses"][i] for r in ranks for i in (0, 2, 3)], [losses[i] for _ in ranks for i in (0, 2, 3)],
                 "train_loss")
