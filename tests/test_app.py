"""The application — Hydra configs compose, and the real command lines users type
(`python examples/train.py ...`, `-m` sweeps, torchrun) train, log and write summary.json.
Every run is a subprocess with a clean environment: Lightning's popen launcher re-runs argv."""
from __future__ import annotations

import inspect
import json
import os
import re
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from app_config import compose_app
from procenv import clean_env

from lightning_bfpp.checkpoint import read_meta

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
CONF = ROOT / "conf"
FAST = ["trainer.max_steps=3", "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false",
        "data.max_bytes=400000"]
SUMMARY_KEYS = {"train_loss", "val_loss", "tokens_per_s", "bubble_fraction", "schedule", "pipeline_parallel",
                "data_parallel", "loops", "micro_batches", "world_size", "steps"}


def run_cli(args: list[str], cwd: Path, launcher: list[str] | None = None,
            timeout: int = 300) -> subprocess.CompletedProcess:
    env = clean_env()
    cmd = (launcher or [sys.executable]) + [str(TRAIN), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def read_summary(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys(), SUMMARY_KEYS - summary.keys()
    assert summary["steps"] == 3 and summary["val_step"] == 3
    assert 0 < summary["val_loss"] < 6 and 0 < summary["train_loss"] < 6 and summary["tokens_per_s"] > 0
    return summary


def documented_metrics() -> set[str]:
    """The metric names docs/training.md lists in its table of what is logged (`{a,b}` spelled out)."""
    table = (ROOT / "docs" / "training.md").read_text().split("| metric |")[1].split("\n\n")[0]
    names = set()
    for token in re.findall(r"`([^`]+)`", "\n".join(row.split("|")[1] for row in table.splitlines()[2:])):
        head, brace, tail = token.partition("{")
        choices, _, rest = tail.partition("}")
        names |= {head + choice + rest for choice in choices.split(",")} if brace else {token}
    return names


def assert_documented(logged) -> None:
    missing = sorted(set(logged) - documented_metrics() - {"step"})  # the CSV's step column
    assert not missing, f"logged but not listed in docs/training.md: {missing}"


def read_wandb_offline(run_file: Path) -> list:
    """Records of an offline W&B run (`run-*.wandb`): a LevelDB-style log of protobuf `Record`s.
    wandb 0.31 has no Python reader any more; the format: 7-byte header (':W&B', magic, version),
    then 32 KiB blocks of chunks `crc32:u32 length:u16 type:u8 payload` (1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = run_file.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B", f"{run_file} is not a W&B datastore"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too short for a header: zero padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pb.Record.FromString(pending))
            pending = b""
    return records


def wandb_run(run_dir: Path) -> tuple[str, str, dict]:
    """(run id, group, config) of the offline W&B run in `run_dir`."""
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run_id, group, config = None, None, {}
    for rec in read_wandb_offline(run_file):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id, group = rec.run.run_id, rec.run.run_group
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in rec.config.update})
    return run_id, group, config


def assert_logs_not_empty(run_dir: Path) -> None:
    """Rank 0's log file exists; no rank leaves an empty one behind."""
    logs = {p.name: p.stat().st_size for p in run_dir.glob("*.log")}
    assert logs.get("train.log", 0) > 0 and all(logs.values()), logs


def wandb_history(run_dir: Path) -> list[dict]:
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = []
    for rec in read_wandb_offline(run_file):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


# ---- no processes ----
@pytest.mark.parametrize("schedule", ["breadth_first", "depth_first", "gpipe", "1f1b"])
@pytest.mark.parametrize("cluster", ["cpu_1", "cpu_2", "cpu_4", "gpu_8", "slurm_gpu_64"])
def test_configs_compose(schedule, cluster):
    cfg = compose_app([f"schedule={schedule}", f"cluster={cluster}"])
    assert cfg.data.block_size == cfg.model.block_size
    assert cfg.trainer.strategy == "bfpp" and cfg.logger.name == "wandb" and cfg.optim.name == "adamw"
    assert cfg.schedule.name == schedule and cfg.cluster.name == cluster


def test_schedule_keys_are_strategy_arguments():
    from lightning_bfpp import BFPPStrategy

    params = set(inspect.signature(BFPPStrategy).parameters)
    schedules = sorted((CONF / "schedule").glob("*.yaml"))
    assert schedules, CONF / "schedule"
    for path in schedules:
        cfg = compose_app([f"schedule={path.stem}"])
        keys = set(cfg.schedule) - {"name"} | {"schedule"}
        assert keys <= params, f"{path.name}: {keys - params} are not BFPPStrategy arguments"


# ---- one process ----
def test_cli_plain_lightning_writes_summary_and_csv(tmp_path):
    run_cli(["cluster=cpu_1", "cluster.peak_flops=1.0e12", "trainer.strategy=auto", "logger=csv", "data.batch_size=8",
             *FAST, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    summary = read_summary(tmp_path / "run")
    assert summary["schedule"] == "none" and summary["world_size"] == 1 and summary["bubble_fraction"] is None
    assert summary["mfu"] == pytest.approx(summary["model_flops_per_s"] / 1.0e12)
    (metrics,) = (tmp_path / "run").glob("csv/version_*/metrics.csv")
    header = metrics.read_text().splitlines()[0].split(",")
    assert {"train_loss", "val_loss", "tokens_per_s", "step_s", "model_flops_per_s", "mfu"} <= set(header)
    assert {"lr-AdamW/pg1", "lr-AdamW/pg2"} <= set(header)  # LearningRateMonitor
    assert_documented(header)
    assert (tmp_path / "run" / ".hydra" / "config.yaml").exists()
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()  # saved at the end by default


@pytest.mark.slow
def test_cli_trains_for_epochs_and_validates_the_final_model(tmp_path):
    """trainer.max_steps=-1 with +trainer.max_epochs: the LR schedule spans Lightning's estimated steps and the
    summary's val_loss is the final model's (validated after the last batch of the last epoch)."""
    run_cli(["cluster=cpu_1", "trainer.strategy=auto", "logger=none", "trainer.enable_progress_bar=false",
             "trainer.max_steps=-1", "+trainer.max_epochs=1", "data.max_bytes=60000", "trainer.limit_val_batches=2",
             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 27  # one epoch: 57000 training bytes hold 890 windows of 65 bytes, 27 batches of 32
    assert summary["val_step"] == 27 and 0 < summary["val_loss"] < 6


def test_cli_bfpp_one_process_logs_to_wandb_offline(tmp_path):
    """Logs, the run config, the schedule image; a run resumed from its last.ckpt continues the same W&B run
    and keeps checkpointing."""
    run_dir = tmp_path / "run"
    one_process = ["cluster=cpu_1", "schedule.pipeline_parallel=1", "schedule.loops=1", "schedule.micro_batches=2",
                   "logger=wandb", "data.batch_size=8", "model.tie_weights=true"]
    run_cli([*one_process, *FAST, "checkpoint.every_n_steps=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step-2.ckpt"]
    assert read_meta(checkpoints / "last.ckpt")["global_step"] == 3  # the end of training, not the last step-N
    summary = read_summary(run_dir)
    assert summary["schedule"] == "breadth_first" and summary["pipeline_parallel"] == 1
    assert summary["micro_batches"] == 2 and summary["data_parallel"] == 1
    assert summary["params"] == 834_304  # gpt_tiny with the embedding tied to the head: that matrix counted once
    run_id, group, config = wandb_run(run_dir)
    assert {"world_size": 1, "data_parallel": 1, "params": 834_304}.items() <= config.items()
    assert config["schedule"]["name"] == "breadth_first" and group == ""
    rows = wandb_history(run_dir)
    logged = set().union(*rows)
    assert {"train_loss", "val_loss", "tokens_per_s", "bubble_fraction", "trainer/global_step"} <= logged
    assert_documented(key for key in logged if not key.startswith(("_", "schedule/")))  # W&B's own; the image
    assert {"lr-AdamW/pg1", "lr-AdamW/pg2"} <= logged  # LearningRateMonitor
    assert any(key.startswith("mem/") for key in logged)
    images = [row for row in rows if row.get("schedule/_type") == "images/separated" or "schedule/filenames" in row
              or row.get("schedule/_type") == "image-file"]
    assert images, f"no schedule image among logged keys {sorted(logged)}"
    assert list(run_dir.glob("wandb/offline-run-*/files/media/images/schedule*.png"))
    assert (run_dir / "schedule.png").exists()
    assert_logs_not_empty(run_dir)

    resumed = tmp_path / "resumed"
    run_cli([*one_process, *FAST, "trainer.max_steps=4", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
             f"hydra.run.dir={resumed}"], cwd=tmp_path)
    assert wandb_run(resumed)[0] == run_id  # the same W&B run, continued
    assert json.loads((resumed / "summary.json").read_text())["steps"] == 4
    assert (resumed / "checkpoints" / "last.ckpt" / "meta.pt").exists()  # and it keeps checkpointing

    # resumed into its own directory: last.ckpt and the step files are replaced in place (no last-v1.ckpt), and the
    # partial save of a process killed mid-save there is removed at the start, saying so
    partial = checkpoints / ".step-4.ckpt.tmp-0badc0de"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    run_cli([*one_process, *FAST, "trainer.max_steps=5", "checkpoint.every_n_steps=2", "logger=csv",
             f"ckpt_path={checkpoints / 'last.ckpt'}", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step-2.ckpt", "step-4.ckpt"]
    log = (run_dir / "train.log").read_text()
    assert f"removed {partial} (7 B): the partial checkpoint of an interrupted save" in log
    assert read_meta(checkpoints / "last.ckpt")["global_step"] == 5
    assert [p.name for p in run_dir.glob("csv/version_*")] == ["version_0"]  # one metrics file per run directory


# ---- several processes (Lightning's popen launcher, torchrun) ----
@pytest.mark.slow
def test_cli_default_config_on_four_processes(tmp_path):
    """`make train` at a few steps: cpu_4, breadth_first pp=2 x loops=2 -> dp=2."""
    run_cli(["logger=csv", *FAST, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 4 and summary["pipeline_parallel"] == 2 and summary["data_parallel"] == 2
    assert summary["loops"] == 2 and summary["schedule"] == "breadth_first"
    assert summary["bubble_fraction"] >= 0  # idle / busy time: can pass 1 on a loaded machine
    assert_logs_not_empty(tmp_path / "run")
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt" / "meta.pt").exists()
    assert not (tmp_path / "outputs").exists()  # children reused the parent's run dir


@pytest.mark.slow
def test_cli_multirun_sweeps_schedules_on_two_processes(tmp_path):
    """`-m` with the popen launcher: each job's children run that job only, in that job's dir; each job
    gets its own W&B run and a fresh process group. (Two jobs show it; every schedule's CLI run is in
    test_cli_layouts and its exactness in test_exactness.)"""
    sweep = tmp_path / "sweep"
    run_cli(["-m", "schedule=depth_first,1f1b", "cluster=cpu_2", "schedule.micro_batches=2",
             "data.batch_size=4", "logger=wandb", *FAST, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=600)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0_schedule-depth_first", "1_schedule-1f1b"]  # the swept values
    for job in jobs:
        summary = read_summary(job)
        assert job.name.endswith(summary["schedule"]) and summary["world_size"] == 2
        assert summary["pipeline_parallel"] == 2 and summary["data_parallel"] == 1
        assert_logs_not_empty(job)
        assert len(list(job.glob("wandb/offline-run-*/run-*.wandb"))) == 1  # one W&B run per job, not one per sweep
        assert "val_loss" in set().union(*wandb_history(job))
        _, group, config = wandb_run(job)
        assert group == str(sweep) and config["world_size"] == 2 and config["data_parallel"] == 1  # one group per sweep
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


@pytest.mark.slow
def test_cli_torchrun_shares_one_run_dir(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    run_cli(["cluster=cpu_2", "schedule=gpipe", "schedule.micro_batches=2", "data.batch_size=4", "logger=csv", *FAST],
            cwd=tmp_path, launcher=torchrun)
    (run_dir,) = (tmp_path / "outputs").iterdir()
    assert run_dir.name.startswith("torchrun-")
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["schedule"] == "gpipe"
    assert_logs_not_empty(run_dir)


@pytest.mark.slow
def test_cli_slurm_tasks_share_one_run_dir(tmp_path):
    """What `srun` does: start every task itself with SLURM_* set (here two local tasks, no srun)."""
    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242",
             "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1"}
    cmd = [sys.executable, str(TRAIN), "cluster=cpu_2", "schedule=1f1b", "schedule.micro_batches=2",
           "data.batch_size=4", "logger=csv", *FAST]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(**slurm, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-5000:]
    (run_dir,) = (tmp_path / "outputs").iterdir()
    assert run_dir.name == "slurm-4242.0"
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["schedule"] == "1f1b"
    assert_logs_not_empty(run_dir)


def test_cli_rejects_a_batch_that_does_not_split(tmp_path):
    proc = subprocess.run([sys.executable, str(TRAIN), "cluster=cpu_1", "schedule.pipeline_parallel=1",
                           "schedule.loops=1", "schedule.micro_batches=4", "data.batch_size=6", "logger=none", *FAST,
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "data.batch_size=6 (global, per optimizer step) must be divisible by" in proc.stdout + proc.stderr


# ---- run directories: never shared by two runs ----
from app import run_dir as rundir  # noqa: E402


def test_run_dir_lock_refuses_a_live_run_and_takes_over_a_stale_one(tmp_path):
    lock = tmp_path / rundir.LOCK_NAME
    me = {"host": socket.gethostname()}
    live = os.getppid()  # a live process that is not this one
    lock.write_text(json.dumps({**me, "pid": live, "start": rundir._start_time(live)}))
    with pytest.raises(rundir.RunDirInUse, match=f"hydra.run.dir={tmp_path} is in use by a live run: pid {live}"):
        rundir.acquire(tmp_path)
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1}))  # another host: cannot be checked, refused
    with pytest.raises(rundir.RunDirInUse, match="host 'elsewhere'"):
        rundir.acquire(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    reused = {**me, "pid": live, "start": "1"}  # a live pid that started at another time: a reused pid, stale
    for stale in ({**me, "pid": int(dead.stdout)}, reused):
        lock.write_text(json.dumps(stale))
        assert rundir.acquire(tmp_path) == lock and json.loads(lock.read_text())["pid"] == os.getpid()
        rundir.release(lock)
        assert not lock.exists()


def test_two_launches_name_different_run_dirs():
    cmd = [sys.executable, "-c", "from app import run_dir; print(run_dir.run_id('2026-01-01/00-00-00'))"]
    names = {subprocess.run(cmd, cwd=ROOT / "examples", capture_output=True, text=True, check=True).stdout.strip()
             for _ in range(2)}
    assert len(names) == 2 and all(n.startswith("2026-01-01/00-00-00-") for n in names), names


@pytest.mark.slow
def test_cli_two_runs_started_at_once_get_their_own_directories(tmp_path):
    """Two launches at once with default output settings (cpu_2 under bfpp, cpu_1 plain Lightning) finish in
    their own directories with their own checkpoints; +trainer.* reaches the Trainer (max_epochs=1 x 2 batches
    stops the second run at 2 of 3 steps); a launch into a directory a live run holds is refused at once."""
    common = ["logger=csv", "data.batch_size=4", "data.max_bytes=100000", "trainer.limit_val_batches=1",
              "trainer.enable_progress_bar=false"]
    runs = {"cpu_2": ["cluster=cpu_2", "schedule=gpipe", "schedule.micro_batches=2", "trainer.max_steps=2"],
            "cpu_1": ["cluster=cpu_1", "trainer.strategy=auto", "trainer.max_steps=3", "+trainer.max_epochs=1",
                      "+trainer.limit_train_batches=2"]}
    held = tmp_path / "held"
    lock = rundir.acquire(held)  # this test process plays the live run that owns `held`
    try:
        cmds = [[sys.executable, str(TRAIN), *common, *args] for args in runs.values()]
        cmds.append([sys.executable, str(TRAIN), *common, *runs["cpu_1"], f"hydra.run.dir={held}"])
        procs = [subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for cmd in cmds]
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        rundir.release(lock)
    for proc, out in zip(procs[:2], outputs):
        assert proc.returncode == 0, out[-5000:]
    assert procs[2].returncode == 2 and f"hydra.run.dir={held} is in use by a live run: pid {os.getpid()}" in outputs[2]
    assert sorted(p.name for p in held.iterdir()) == []  # the refused run wrote nothing there
    dirs = sorted(tmp_path.glob("outputs/*/*"))
    assert len(dirs) == 2, dirs
    by_cluster = {json.loads((d / "summary.json").read_text())["cluster"]: d for d in dirs}
    assert sorted(by_cluster) == ["cpu_1", "cpu_2"]
    for cluster, d in by_cluster.items():
        assert f"cluster={cluster}" in (d / ".hydra" / "overrides.yaml").read_text()
        assert [p.name for p in d.glob("csv/version_*")] == ["version_0"] and not (d / rundir.LOCK_NAME).exists()
        assert json.loads((d / "summary.json").read_text())["steps"] == 2
    assert (by_cluster["cpu_2"] / "checkpoints" / "last.ckpt" / "meta.pt").exists()  # a bfpp folder
    assert (by_cluster["cpu_1"] / "checkpoints" / "last.ckpt").is_file()


def test_trainer_keys_reach_the_trainer():
    import train

    cfg = compose_app(["+trainer.max_epochs=1", "+trainer.deterministic=true", "trainer.max_steps=50"])
    kwargs = train.trainer_arguments(cfg)
    assert kwargs["max_epochs"] == 1 and kwargs["deterministic"] is True and "strategy" not in kwargs
    assert kwargs["val_check_interval"] == 50 and kwargs["num_sanity_val_steps"] == 0  # capped at max_steps
