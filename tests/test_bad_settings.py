"""Bad settings through the real command line: `python examples/train.py <overrides>` exits non-zero quickly (on an
idle machine in well under a minute) with an error naming the setting, before any training process starts (no hang,
no half-started job).
The app's own rules (examples/app/checks.py) are also checked in this process, without a command line.

The rows run as concurrent subprocesses (one module-scoped fixture, 4 at a time), ~8 s of CPU (imports) and
~10-20 s of wall-clock time each on 2 cores. "Fails fast" is checked against what the machine allows right now, so
that load cannot break it: a baseline process in the same pool (the app's imports, nothing else) measures how much the
machine stretches a process's CPU time into wall-clock time (`stretch`, ~2 when 4 processes share 2 idle cores, ~9
beside a CPU hog and a loaded test run); a row must end within 2 x stretch x its own CPU time + 15 s (the load
changes while the rows run). A row that waits (for a peer, a timeout) spends wall-clock time without CPU time: a wait
of ~25 s fails it on an idle machine, ~35 s with 4 rows on 2 cores, ~90 s under heavy load. A run still going after
HANG_S is killed and counts as hung."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from app.checks import ConfigError, check_config
from app_config import compose_app
from launch import ROOT, clean_env

TRAIN = ROOT / "examples" / "train.py"
QUIET = ["logger=none", "trainer.enable_progress_bar=false"]
SLACK_S = 15  # wall-clock seconds a failing run may take beyond what its CPU time explains on this machine now
HANG_S = 300  # wall-clock seconds after which a run counts as hung (and is killed)
BASELINE = "baseline_imports"  # the app's imports and nothing else (`import train`), run beside the rows
# What Lightning prints when it sets up the process group, i.e. once processes have started.
STARTED = ("Initializing distributed", "distributed_backend=")

# (id, overrides, the setting the error must name); default config: cpu_4, breadth_first pp=2 loops=2 m=4,
# gpt_tiny (4 blocks + embedding + head = 6 layers), global batch 32.
ROWS = [
    ("world_not_divisible_by_pp", ["schedule.pipeline_parallel=3"], "schedule.pipeline_parallel"),
    ("more_stages_than_layers", ["schedule.loops=4"], "schedule.loops"),
    ("batch_not_divisible", ["data.batch_size=30"], "data.batch_size"),
    ("loops_on_unlooped_schedule", ["schedule=gpipe", "schedule.loops=2"], "loops=2"),
    ("unknown_schedule", ["schedule.name=zigzag"], "schedule='zigzag'"),
    ("unknown_sharding", ["schedule.sharding=zero2"], "sharding='zero2'"),
    ("zero_pipeline_parallel", ["schedule.pipeline_parallel=0"], "pipeline_parallel=0"),
    ("zero_micro_batches", ["schedule.micro_batches=0"], "micro_batches=0"),
    ("stage_layers_wrong_count", ["schedule.stage_layers=[3,3]"], "stage_layers=[3, 3]"),
    # right count, wrong sum: only the model knows its layers, checked by the launcher in the parent
    ("stage_layers_wrong_sum", ["schedule.stage_layers=[1,1,1,1]"], "stage_layers=[1, 1, 1, 1]"),
    ("groups_not_dividing_micro_batches", ["schedule.groups=3"], "groups=3"),
    ("zero_devices", ["cluster.devices=0"], "cluster.devices"),
    ("heads_not_dividing_width", ["model.n_head=3"], "model.n_head"),
    ("zero_max_steps", ["trainer.max_steps=0"], "trainer.max_steps"),
    # refused before any process starts (not a NaN loss at step 1)
    ("negative_lr", ["optim.lr=-1"], "optim.lr=-1"),
    ("corpus_shorter_than_a_window", ["data.max_bytes=50"], "data.max_bytes=50"),
    ("fp16_without_loss_scaling", ["trainer.precision=16-true"], "trainer.precision='16-true'"),
    ("sequence_parallel_without_tensor_parallel", ["schedule.sequence_parallel=true"], "schedule.tensor_parallel=1"),
    ("sequence_not_dividing_by_tp", ["schedule.pipeline_parallel=1", "schedule.loops=1", "schedule.tensor_parallel=2",
                                     "schedule.sequence_parallel=true", "model.block_size=63"], "data.block_size=63"),
    # read from the command line before Hydra composes the config: "did you mean" first, not Hydra's `+` advice
    ("misspelt_trainer_key", ["trainer.max_step=10"],
     "error: trainer.max_step=10: the config has no key trainer.max_step; did you mean trainer.max_steps?"),
    ("misspelt_schedule_file", ["schedule=breadth_frist"], "did you mean schedule=breadth_first?"),
    ("expert_parallel_without_experts", ["schedule.expert_parallel=2"], "schedule.expert_parallel=2"),
    ("context_parallel_not_dividing_world", ["schedule.context_parallel=3"], "schedule.context_parallel"),
    ("sequence_not_dividing_by_2cp", ["schedule.context_parallel=2", "model.block_size=62"], "data.block_size=62"),
]


@dataclass
class Result:
    returncode: int | None  # None: killed as hung
    wall_s: float
    cpu_s: float  # user + system time of the process
    output: str
    run_dir: Path


def _train(overrides: list[str], run_dir: Path, launcher: list[str] | None = None) -> Result:
    return _run([*(launcher or [sys.executable]), str(TRAIN), *overrides, *QUIET, f"hydra.run.dir={run_dir}"], run_dir)


def _run(cmd: list[str], run_dir: Path) -> Result:
    log = run_dir.parent / f"{run_dir.name}.out"
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=run_dir.parent, env=clean_env(), stdout=out, stderr=subprocess.STDOUT)
    code = None
    while True:  # reap it ourselves: os.wait4 also returns its CPU time
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            code = proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() - start > HANG_S:
            proc.kill()
            _, _, usage = os.wait4(proc.pid, 0)
            proc.returncode = -9
            break
        time.sleep(0.1)
    output = log.read_text() + ("" if code is not None else f"\n<killed: still running after {HANG_S} s>")
    return Result(code, time.monotonic() - start, usage.ru_utime + usage.ru_stime, output, run_dir)


# Under torchrun every rank starts at once (no launcher to check first): the model check runs in each rank's
# setup, and every rank fails with the same error instead of waiting for the others.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
TORCHRUN_ROW = ("torchrun_stage_layers_wrong_sum", ["cluster=cpu_2", "schedule.stage_layers=[1,1,1,1]"],
                "stage_layers=[1, 1, 1, 1]")


# `make test` runs these rows (one per kind of check); the others, and torchrun's, are in the slow set
FAST = {"world_not_divisible_by_pp", "stage_layers_wrong_sum", "negative_lr", "misspelt_trainer_key"}


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict[str, Result]:
    """Runs the rows of the selected tests only (`-m "not slow"` deselects most)."""
    mine = [item for item in request.session.items if item.module is request.module]
    selected = {item.callspec.params.get("name") for item in mine if hasattr(item, "callspec")}
    if any(item.name == "test_bad_setting_under_torchrun_fails_on_every_rank" for item in mine):
        selected.add(TORCHRUN_ROW[0])
    root = tmp_path_factory.mktemp("bad_settings")
    baseline = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TRAIN.parent)!r}); import train"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {BASELINE: pool.submit(_run, baseline, root / BASELINE)}  # in the first batch of 4
        futures.update({name: pool.submit(_train, overrides, root / name)
                        for name, overrides, _ in ROWS if name in selected})
        if TORCHRUN_ROW[0] in selected:
            futures[TORCHRUN_ROW[0]] = pool.submit(_train, TORCHRUN_ROW[1], root / TORCHRUN_ROW[0], TORCHRUN)
        return {name: future.result() for name, future in futures.items()}


def stretch(results: dict[str, Result]) -> float:
    """Wall-clock seconds per CPU second of the baseline process, which ran beside the first rows."""
    base = results[BASELINE]
    assert base.returncode == 0, base.output[-2000:]
    return base.wall_s / base.cpu_s


def ends_fast(r: Result, results: dict[str, Result]) -> tuple[bool, str]:
    """Whether `r` ended within what its CPU time explains on this machine now, and a line saying so."""
    k = stretch(results)
    limit = 2 * k * r.cpu_s + SLACK_S
    return r.wall_s <= limit, f"{r.wall_s:.1f} s wall-clock against a limit of {limit:.1f} s (stretch {k:.2f})"


def test_a_run_that_waits_is_not_fast_loaded_or_not():
    """The limit follows the machine's stretch, but waiting (wall-clock time without CPU time) still fails it."""
    def result(wall_s, cpu_s):
        return Result(0, wall_s, cpu_s, "", Path("."))

    # (baseline wall, CPU), a wait that must be caught: idle, 4 processes on 2 cores, loaded (measured: 52 s / 6.6 s)
    for base_wall, base_cpu, wait in ((7.0, 6.5, 30), (14.0, 7.0, 40), (61.0, 7.0, 100)):
        runs = {BASELINE: result(base_wall, base_cpu)}
        k = base_wall / base_cpu
        assert ends_fast(result(k * 8.5, 8.5), runs)[0]  # a row doing its imports and checks as the baseline does
        assert not ends_fast(result(k * 8.5 + wait, 8.5), runs)[0]  # ... then waiting for a peer or a timeout


def test_the_table_covers_enough_settings():
    assert len(ROWS) >= 10 and len({name for name, _, _ in ROWS}) == len(ROWS)


@pytest.mark.parametrize("name, overrides, setting",
                         [row if row[0] in FAST else pytest.param(*row, marks=pytest.mark.slow) for row in ROWS],
                         ids=[row[0] for row in ROWS])
def test_bad_setting_fails_fast_naming_the_setting(results, name, overrides, setting):
    r = results[name]
    tail = "\n".join(r.output.splitlines()[-15:])
    where = (f"{' '.join(overrides)}: exit {r.returncode} after {r.wall_s:.1f} s ({r.cpu_s:.1f} s CPU); "
             f"output tail:\n{tail}")
    assert r.returncode not in (0, None), where
    fast, line = ends_fast(r, results)
    assert fast, f"{line}; {where}"
    assert setting in r.output, f"the error does not name {setting!r}; {where}"
    assert "To append to your config use +" not in r.output, f"Hydra's advice for a key the app knows; {where}"
    started = [marker for marker in STARTED if marker in r.output]
    assert not started and not list(r.run_dir.glob("*_ddp_process_*.log")), f"processes were started; {where}"


@pytest.mark.slow
def test_bad_setting_under_torchrun_fails_on_every_rank(results):
    name, overrides, setting = TORCHRUN_ROW
    r = results[name]
    where = (f"torchrun {' '.join(overrides)}: exit {r.returncode} after {r.wall_s:.1f} s ({r.cpu_s:.1f} s CPU, "
             f"all ranks); output tail:\n" + "\n".join(r.output.splitlines()[-25:]))
    assert r.returncode not in (0, None), where
    fast, line = ends_fast(r, results)
    assert fast, f"{line}; {where}"
    raised = [line for line in r.output.splitlines() if line.startswith(f"ValueError: {setting}")]
    assert raised and "timed out" not in r.output.lower(), where  # the check itself, not a peer's timeout


# ---- the app's rules, in this process (compose + check_config; no command line, no processes) ----
CHECKS = [  # (overrides, what the error must say)
    (["optim.lr=-1"], "optim.lr=-1 must be a number > 0"),
    (["schedule.loops=0"], "schedule.loops=0 must be a positive integer"),  # not replaced by a default
    (["schedule.groups=0"], "schedule.groups=0 must be a positive integer"),
    (["schedule.sharding=''"], "schedule.sharding='' is unknown"),
    (["optim.lr=0"], "optim.lr=0 must be a number > 0"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be >= 0"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps=-1"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2 must be in [0, 1]"),
    (["optim.betas=[0.9,1.5]"], "optim.betas=[0.9, 1.5] must be two numbers in [0, 1)"),
    (["optim.eps=0"], "optim.eps=0 must be a number > 0"),
    (["optim=sgd", "optim.momentum=-0.5"], "optim.momentum=-0.5"),
    (["data.max_bytes=50"], "data.max_bytes=50 is too small: its training split (47 bytes) holds 0 windows"),
    (["data.max_bytes=2000"], "fewer than one batch of data.batch_size=32 (16 per data-parallel replica x 2)"),
    (["data.max_bytes=30000"], "data.max_bytes=30000 is too small for validation"),
    (["data.max_bytes=30000", "data.stride=1000"], "its training split (28500 bytes) holds 29 windows"),
    (["trainer.precision=16-true"], "trainer.precision='16-true': fp16 weights without loss scaling"),
    (["trainer.precision=16"], "trainer.precision=16 needs fp16 loss scaling, which strategy=bfpp does not do"),
    (["trainer.strategy=auto", "trainer.precision=16-mixed"], "needs a GPU (cluster.accelerator=cpu)"),
    (["trainer.precision=64-true"], "trainer.precision='64-true' is not supported with trainer.strategy=bfpp"),
    (["trainer.precision=transformer-engine"], "not supported with trainer.strategy=bfpp"),
    (["+trainer.devices=2"], "trainer.devices=2 is set by examples/train.py from cluster.devices"),
    (["+trainer.logger=false"], "from logger=wandb|csv|none"),
    (["+trainer.enable_checkpointing=false"], "checkpoint.last=false"),
    (["+trainer.max_epoch=1"],
     "trainer.max_epoch=1 is not an argument of lightning.Trainer; did you mean trainer.max_epochs?"),
    (["trainer.strategy=ddp"], "trainer.strategy='ddp': use trainer.strategy=bfpp"),
    # accepted without a word, or failing only after the processes started (a user's try)
    (["trainer.max_steps=-1"],
     "trainer.max_steps=-1 must be a positive integer, or -1 (no step limit) with +trainer.max_epochs=N"),
    (["schedule=base"], "schedule=base holds the knobs every schedule shares, it is not a schedule"),
    (["trainer.val_check_interval=0"], "trainer.val_check_interval=0 must be a number of batches >= 1"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0 must be an integer >= 1"),
    (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val=-1 must be >= 0 or null"),
    (["checkpoint.every_n_steps=-1"], "checkpoint.every_n_steps=-1 must be an integer >= 0"),
    (["checkpoint.async_save=maybe"], "checkpoint.async_save='maybe' must be true or false"),
    (["checkpoint.on_signal=later"], "checkpoint.on_signal='later' must be save or exit"),
    (["checkpoint.on_signal_grace_s=0"], "checkpoint.on_signal_grace_s=0 must be > 0 seconds or null"),
    (["data.num_workers=-1"], "data.num_workers=-1 must be an integer >= 0"),
    (["logger=wandb", "logger.mode=bogus"], "logger.mode='bogus': use logger.mode=offline or online"),
    # expert parallel: a model with experts, dividing them and the data-parallel ranks, without tp, sharded
    (["schedule.expert_parallel=2"], "schedule.expert_parallel=2 splits the experts of a mixture of experts, and "
     "model=gpt_tiny has none (model.n_experts=0); use model=gpt_moe_tiny"),
    (["model=gpt_moe_tiny", "schedule.expert_parallel=3"], "schedule.expert_parallel=3 must divide model.n_experts=4"),
    (["model=gpt_moe_tiny", "schedule.expert_parallel=4"],
     "schedule.expert_parallel=4 must divide the data-parallel size 2"),
    (["model=gpt_moe_tiny", "schedule.tensor_parallel=2", "schedule.expert_parallel=2"],  # pp=2 x tp=2: dp 1
     "schedule.expert_parallel=2 must divide the data-parallel size 1"),
    (["model=gpt_moe_tiny", "schedule.pipeline_parallel=1", "schedule.tensor_parallel=2",
      "schedule.context_parallel=2", "schedule.expert_parallel=2"],
     "schedule.expert_parallel=2 with schedule.tensor_parallel=2 and schedule.context_parallel=2: expert parallel "
     "combines with tensor parallel or with context parallel, not with both at once yet"),
    (["model=gpt_moe_tiny", "schedule.sharding=none", "schedule.expert_parallel=2"],
     "schedule.expert_parallel=2 with schedule.sharding='none'"),
    (["model=gpt_moe_tiny", "schedule.expert_parallel=0"], "schedule.expert_parallel=0 must be a positive integer"),
    (["schedule.cross_step_overlap=maybe"], "schedule.cross_step_overlap='maybe' must be true or false"),
    (["schedule.shard_unit=block"], "schedule.shard_unit='block' must be stage or layer"),
    (["schedule.shard_unit=layer", "schedule.sharding=none"],
     "shard_unit='layer' (Hydra: schedule.shard_unit=layer) splits FSDP's sharding into one unit per layer, and "
     "sharding='none' (Hydra: schedule.sharding=none) shards nothing"),
    (["schedule.cuda_graphs=true"], "schedule.cuda_graphs=true needs a CUDA device (cluster=cpu_4 is cpu)"),
    (["trace.enabled=yes"], "trace.enabled='yes' must be true or false"),
    (["trace.count=0"], "trace.count=0 must be an integer >= 1"),
]
ACCEPTED = [
    [], ["+trainer.max_epochs=1", "+trainer.limit_train_batches=5"], ["trainer.precision=bf16-mixed"],
    ["trainer.precision=bf16-true"], ["trainer.strategy=auto", "trainer.precision=64-true"],
    ["trainer.strategy=auto", "cluster=gpu_8", "trainer.precision=16-mixed"],
    ["data.max_bytes=30000", "trainer.limit_val_batches=0"],  # no validation: no validation split needed
    ["optim=sgd", "optim.lr=1e-4", "optim.warmup_steps=0", "optim.min_lr_ratio=1"],
    ["trainer.max_steps=-1", "+trainer.max_epochs=2"],  # epoch-bounded training
    ["checkpoint.on_signal=exit", "checkpoint.on_signal_grace_s=10", "ckpt_path=null", "checkpoint.async_save=true"],
    ["model=gpt_moe_tiny", "schedule.expert_parallel=2"],
    ["model=gpt_moe_tiny", "schedule.pipeline_parallel=1", "schedule.tensor_parallel=2", "schedule.expert_parallel=2"],
    ["model=gpt_moe_tiny", "schedule.pipeline_parallel=1", "schedule.tensor_parallel=2",
     "schedule.sequence_parallel=true", "schedule.expert_parallel=2"],
    ["schedule.cross_step_overlap=true", "trace.enabled=true", "trace.count=1"],
    ["cluster=gpu_8", "schedule.cuda_graphs=true", "schedule.sharding=none"],
]


@pytest.mark.parametrize("overrides, message", CHECKS, ids=[" ".join(o) for o, _ in CHECKS])
def test_app_setting_is_checked_before_launch(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_config(compose_app(overrides))
    assert message in str(err.value)
    key = overrides[-1].lstrip("+").split("=")[0]
    assert key in str(err.value), f"the error does not name {key}: {err.value}"


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[" ".join(o) or "defaults" for o in ACCEPTED])
def test_legal_settings_pass_the_checks(overrides, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # cluster=gpu_8 is legal where there are GPUs
    check_config(compose_app(overrides))


def test_a_gpu_cluster_without_a_gpu_names_the_cluster(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"cluster.accelerator=gpu \(cluster=gpu_8\): this machine has no usable GPU"):
        check_config(compose_app(["cluster=gpu_8"]))


@pytest.mark.parametrize("overrides", [
    ["data.max_bytes=50"], ["data.max_bytes=30000"], ["data.max_bytes=9000", "data.batch_size=64"],
    ["data.max_bytes=3000", "cluster=cpu_1", "schedule.pipeline_parallel=1", "data.stride=7"]])
def test_the_corpus_size_the_error_suggests_is_enough(overrides):
    """`use data.max_bytes=N or more`: N passes, N - 1 does not (the suggestion is the least that works)."""
    with pytest.raises(ConfigError) as err:
        check_config(compose_app(overrides))
    need = int(str(err.value).split("use data.max_bytes=")[1].split()[0])
    check_config(compose_app([*overrides, f"data.max_bytes={need}"]))
    with pytest.raises(ConfigError):
        check_config(compose_app([*overrides, f"data.max_bytes={need - 1}"]))
