"""What a run prints matches what it does (issue 54: a newcomer's first hour). One launch of tests/run_output.py with
OMP_NUM_THREADS unset, as a user's shell has it: every rank runs with Lightning's thread rule and the log says the
number; the model summary says whose stages it shows and totals the whole model; without a progress bar a line every
log_every_n_steps; a save and an exact mid-epoch resume print nothing that contradicts them. torchrun and SLURM's
variables check the threads of every rank too (slow set)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch import ROOT, wait_all
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from procenv import clean_env, free_port

SCRIPT = ROOT / "tests" / "run_output.py"
DEVICES = 2
THREADS_LINE = re.compile(r"^bfpp: (\d+) CPU threads? per process \((.*)\)$", re.MULTILINE)


def rule_threads(local_processes: int) -> int:
    """Lightning's rule (lightning.fabric.utilities.distributed._suggested_max_num_threads) on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // local_processes)


def without_threads(**extra: str) -> dict[str, str]:
    """A clean environment without OMP_NUM_THREADS (a user's shell; tests/launch.py sets it to 1)."""
    env = clean_env(PYTHONUNBUFFERED="1", **extra)
    env.pop("OMP_NUM_THREADS", None)
    return env


def finish(procs: list[subprocess.Popen], out: Path, timeout: float = 400) -> tuple[str, list[dict]]:
    """Every process's output (joined) and every rank's record, once all have exited 0."""
    output = "\n".join(wait_all(procs, timeout))
    assert all(p.returncode == 0 for p in procs), output[-6000:]
    return output, [json.loads((out / f"rank{r}.json").read_text()) for r in range(DEVICES)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, list[dict]]:
    """Lightning's launcher: this script's process is rank 0 and starts rank 1."""
    out = tmp_path_factory.mktemp("run_output")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(out), str(DEVICES), "full"], cwd=ROOT,
                            env=without_threads(MASTER_PORT=str(free_port())), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return finish([proc], out)


def test_every_rank_gets_lightnings_thread_rule_and_the_log_says_it_once(run):
    output, records = run
    assert [r["global_steps"] for r in records] == [[3, 4]] * DEVICES  # the fit and the resumed fit ran
    expected = rule_threads(DEVICES)
    assert [r["threads"] for r in records] == [[expected, expected]] * DEVICES  # rank 1 had all the cores before
    said = THREADS_LINE.findall(output)  # once per fit, by global rank 0
    assert said == [(str(expected), f"{rule_threads(1)} cores / 2 processes on this node, Lightning's rule; "
                                    "OMP_NUM_THREADS=N to choose")] * 2, said


def test_the_model_summary_says_whose_stages_it_shows_and_totals_the_whole_model(run):
    output, records = run
    assert ("bfpp: the model summary shows global rank 0's modules: pipeline rank 0's stages 0, 2 of 4; the layers of "
            "the other pipeline ranks are RemoteLayer placeholders with 0 params here. Its totals are the whole "
            "model's.") in output
    totals = re.findall(r"^Total params: (.+?)\s*$", output, re.MULTILINE)
    assert totals == [get_human_readable_count(records[0]["params"])] * 2, totals  # not rank 0's share


def test_without_a_progress_bar_a_line_every_log_every_n_steps(run):
    output, _ = run
    said = re.findall(r"^step (\d+/\d+): train_loss \d+\.\d{4}, [\d,]+ tokens/s$", output, re.MULTILINE)
    assert said == ["2/3", "4/4"], said  # log_every_n_steps=2; the resumed fit goes on from step 2


def test_saves_and_an_exact_resume_print_nothing_that_contradicts_them(run):
    output, _ = run
    assert "`weights_only` was not set" not in output  # ModelCheckpoint's saves and the user's own
    assert "not resumable" not in output  # Lightning's warning: bfpp's resume continues the data order
    assert output.count("bfpp: resuming mid-epoch: the training dataloader starts after the 2 batches of the epoch "
                        "the checkpoint had trained on, in the same order (docs/checkpoints.md)") == 1


@pytest.mark.slow
def test_every_rank_gets_the_thread_rule_under_slurm(tmp_path):
    """srun starts every rank itself: no launcher ran Lightning's rule in any of them."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), str(DEVICES), "threads"], cwd=ROOT,
                              env=without_threads(**slurm_task(rank, port)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(DEVICES)]
    output, records = finish(procs, tmp_path)
    assert [r["threads"] for r in records] == [[rule_threads(DEVICES)]] * DEVICES
    assert len(THREADS_LINE.findall(output)) == 1, output[-3000:]


def slurm_task(rank: int, port: str) -> dict[str, str]:
    """What `srun --ntasks=2` on one node sets for task `rank` (as tests/launch.py's start_slurm)."""
    return dict(SLURM_NTASKS=str(DEVICES), SLURM_NTASKS_PER_NODE=str(DEVICES), SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_ID="4242",
                SLURM_JOB_NAME="bfpp-test", SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)


@pytest.mark.slow
def test_torchruns_own_thread_setting_is_kept_on_every_rank(tmp_path):
    """torchrun sets OMP_NUM_THREADS=1 for its workers when it is unset: set before the job, so every rank keeps it,
    and the log says where it came from."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={DEVICES}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(SCRIPT), str(tmp_path), str(DEVICES), "threads"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=without_threads(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    output, records = finish([proc], tmp_path)
    assert [r["threads"] for r in records] == [[1]] * DEVICES
    assert THREADS_LINE.findall(output) == [("1", "OMP_NUM_THREADS=1, set before the job started")], output[-3000:]
