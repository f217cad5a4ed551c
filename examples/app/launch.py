"""How a run starts and ends: the directory a live run holds is refused, Lightning's popen launcher re-runs this
job (not the whole sweep) in its children, and a multirun's next job finds no W&B run, process group, launcher
environment or argv left by the previous one."""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from data import prepare_text
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from . import run_dir as rundir
from .checkpoints import check_resume_model, check_resume_strategy, resolve_ckpt_path
from .checks import ConfigError, check_config
from .strategy import world_size

log = logging.getLogger(__name__)


def prepare_relaunch() -> None:
    """Make Lightning's popen launcher re-run THIS job in its children, in THIS job's directory.

    Lightning re-runs `sys.argv` with `hydra.run.dir=<HydraConfig run.dir>` appended. In a multirun
    (`-m a=1,2`) that would start a whole sweep in every child, in a fresh time-stamped directory;
    so the parent's argv becomes the current job's own overrides and run.dir its output directory.
    """
    hc = HydraConfig.get()
    keep, args = [], iter(sys.argv[1:])
    for arg in args:  # keep --config-name/-cn, --config-path/-cp, --config-dir/-cd (and their values)
        if arg.split("=")[0] in ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd"):
            keep.append(arg)
            if "=" not in arg:
                keep.append(next(args, ""))
    chdir = [o for o in hc.overrides.hydra if o.startswith("hydra.job.chdir=")]
    sys.argv[1:] = keep + list(hc.overrides.task) + chdir
    OmegaConf.set_readonly(hc, False)
    hc.run.dir = hc.runtime.output_dir


def refuse_a_dir_in_use(argv: list[str]) -> None:
    """Before Hydra writes anything: an explicit `hydra.run.dir` that a live run holds is refused (exit 2).
    The popen launcher's children (and torchrun/SLURM ranks > 0) join their own job's directory."""
    target = rundir.explicit_run_dir(argv)
    if target is None or rundir.global_rank() != "0" or {"-m", "--multirun"} & set(argv):
        return
    try:
        rundir.check_free(target)
    except rundir.RunDirInUse as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


@contextmanager
def one_job(cfg: DictConfig, run_dir: Path) -> Iterator[None]:
    """Around one job of a run (one of a multirun's): its settings checked, its directory held and cleaned of partial
    saves, ``ckpt_path=auto`` resolved, the token cache prepared, all before any process starts (a setting to fix
    exits 2 with its message alone); Lightning's launcher set to re-run this job; everything undone at the end."""
    lock = None
    try:
        check_config(cfg)
        lock = rundir.acquire(run_dir) if rundir.global_rank() == "0" else None  # this job's process that owns the dir
        for line in rundir.remove_partial_saves(run_dir) if lock is not None else []:  # no other live run writes there
            log.info(line)
        resolve_ckpt_path(cfg, run_dir)
        check_resume_strategy(cfg)
        check_resume_model(cfg)
        if cfg.data.name == "text":  # the token cache, prepared (or reused) before any process starts
            prepare_text(cfg, checksums=rundir.global_rank() == "0")
    except ConfigError as err:
        if lock is not None:
            rundir.release(lock)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    env_before, argv_before = dict(os.environ), list(sys.argv)
    launches_children = "LOCAL_RANK" not in os.environ and not os.environ.get("SLURM_NTASKS")
    if launches_children and world_size(cfg) > 1:
        prepare_relaunch()
    try:
        yield
    finally:  # a multirun runs the next job in this process: leave no W&B run, process group, launcher env or argv
        import torch.distributed as dist

        if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
            sys.modules["wandb"].finish()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if launches_children:
            os.environ.clear()
            os.environ.update(env_before)
            sys.argv[:] = argv_before  # prepare_relaunch's: the next job's folder reads the sweep from it
        if lock is not None:
            rundir.release(lock)
