"""Examples/train.py's run directory — its default name (unique per launch, shared by every rank of
one job), a sweep job's folder named by its swept values, a lock that keeps two live runs out of one directory,
and, once the lock is taken, the partial saves that an earlier process of this directory left behind (killed mid-save)
removed.
outputs/<date>/<time>-<6 hex>/   one launch (the popen launcher's children get the parent's dir)
outputs/torchrun-<rdzv id>/, outputs/slurm-<job>.<step>/   every rank started by torchrun / SLURM
multirun/<date>/<time>-<6 hex>/<job number>_<swept key>-<value>[_...]/   a job of a `-m` sweep
<run dir>/.run.lock              {"pid", "host", "start"} of the launching process while it runs"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import sys
from pathlib import Path

from omegaconf import OmegaConf

LOCK_NAME = ".run.lock"
# One per launching process: every job of a `-m` sweep (same process) shares it, two launches in the
# same second do not. Children of the popen launcher never resolve it (they get `hydra.run.dir=<parent's>`).
_LAUNCH_TAG = secrets.token_hex(3)


def run_id(default: str) -> str:
    """One run directory for all processes of a job: launchers that start every rank themselves (SLURM,
    torchrun) name the job; otherwise the time stamp `default` plus this launch's random tag."""
    if os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if elastic not in ("", "none"):
        return f"torchrun-{elastic}"
    return f"{default}-{_LAUNCH_TAG}"


def global_rank() -> str:
    """This process's global rank as far as the environment tells before any process group exists:
    torchrun's RANK, SLURM's SLURM_PROCID, or the popen launcher's LOCAL_RANK on NODE_RANK; '0' in a plain run."""
    if "RANK" in os.environ or "SLURM_PROCID" in os.environ:
        return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    if os.environ.get("NODE_RANK", "0") != "0":
        return "node" + os.environ["NODE_RANK"]
    return os.environ.get("LOCAL_RANK", "0")


def output_subdir(default: str) -> str | None:
    """Only global rank 0 writes the composed config (<run dir>/.hydra) when every rank runs Hydra."""
    return default if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0" else None


def rank_suffix() -> str:
    """'' on global rank 0, '_rank<r>' elsewhere: one log file per rank when every rank runs Hydra."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    return "" if rank == "0" else f"_rank{rank}"


def swept_values(default: str) -> str:
    """A `-m` sweep job's folder name after its number: `<last part of the key>-<value>` of every key the command
    line sweeps (`schedule-gpipe_micro_batches-4`), read from the job's own overrides; `default` when nothing is
    swept on the command line (e.g. a sweeper's own params)."""
    from hydra.core.hydra_config import HydraConfig

    from .command_line import overrides_of

    if not HydraConfig.initialized():  # resolved outside a job (e.g. `--cfg hydra --resolve`)
        return default
    swept = {o.key_or_group for o in overrides_of(sys.argv[1:]) if o.is_sweep_override()}
    parts = [f"{o.key_or_group.rsplit('.', 1)[-1]}-{o.get_value_element_as_str()}"
             for o in overrides_of(list(HydraConfig.get().overrides.task)) if o.key_or_group in swept]
    return re.sub(r"[^\w.+-]+", "-", "_".join(parts)) or default  # no '=', '/' or ',': a path Hydra reads as is


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("bfpp_run_id", run_id, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("bfpp_swept", swept_values, replace=True)
    OmegaConf.register_new_resolver("bfpp_rank_suffix", rank_suffix, replace=True)
    OmegaConf.register_new_resolver("bfpp_output_subdir", output_subdir, replace=True)
    from .checks import pretrained_config  # model=hf_pretrained: the saved model's shape

    OmegaConf.register_new_resolver("bfpp_hf_config", pretrained_config, replace=True, use_cache=True)


# ---- the lock ----
class RunDirInUse(RuntimeError):
    """Another live run holds the run directory."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), to tell a reused pid; None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of /proc/<pid>/stat; the name in (...) may hold spaces


def _alive(owner: dict) -> bool:
    """True when the lock's owner still runs (always True for another host: it cannot be checked from here)."""
    if owner.get("host") != socket.gethostname():
        return True
    pid = int(owner.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    start = _start_time(pid)
    return owner.get("start") is None or start is None or start == owner["start"]


def _owner_text(lock: Path, owner: dict) -> str:
    return f"pid {owner.get('pid')} on host {owner.get('host')!r} (lock file {lock})"


def check_free(run_dir: Path) -> None:
    """Raise RunDirInUse when a live run other than this process holds `run_dir` (no side effects)."""
    lock = Path(run_dir) / LOCK_NAME
    try:
        owner = json.loads(lock.read_text())
    except (OSError, ValueError):
        return
    if int(owner.get("pid", -1)) != os.getpid() and _alive(owner):
        raise RunDirInUse(
            f"hydra.run.dir={run_dir} is in use by a live run: {_owner_text(lock, owner)}. Two runs in one "
            "directory overwrite each other's checkpoints and logs; leave hydra.run.dir unset (every launch gets "
            "its own directory) or pick another one. If that run is gone (another host cannot be checked from "
            f"here), delete {lock}."
        )


def acquire(run_dir: Path) -> Path:
    """Take `run_dir`'s lock for this process (a stale one, whose owner has died, is taken over).
    Returns the lock file; raises RunDirInUse if a live run holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid())}
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        check_free(run_dir)
        tmp = run_dir / f"{LOCK_NAME}.{os.getpid()}"
        tmp.write_text(json.dumps(me))
        os.replace(tmp, lock)  # the stale lock is ours now, unless another process replaced it at the same time:
        check_free(run_dir)  # read it back
        return lock
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(me))
    return lock


def release(lock: Path) -> None:
    """Remove `lock` if this process still owns it."""
    try:
        if int(json.loads(lock.read_text()).get("pid", -1)) == os.getpid():
            lock.unlink()
    except (OSError, ValueError):
        pass


def remove_partial_saves(run_dir: Path) -> list[str]:
    """With this directory's lock held (no other live run writes here): every partial save an earlier process left in
    <run dir>/checkpoints and <run dir> (where a save on a signal may go) handled at once, whatever its age; a line per
    folder for the log. A complete checkpoint is never removed (``lightning_bfpp.checkpoint.partial``)."""
    from lightning_bfpp.checkpoint import clean_partial_saves

    folders = [Path(run_dir) / "checkpoints", Path(run_dir)]
    return [line for folder in folders if folder.is_dir() for line in clean_partial_saves(folder, quiet_s=0)]


def explicit_run_dir(argv: list[str]) -> Path | None:
    """The `hydra.run.dir=<dir>` override on a command line (the last one wins), if any."""
    dirs = [a.split("=", 1)[1] for a in argv if a.startswith(("hydra.run.dir=", "+hydra.run.dir=", "++hydra.run.dir="))]
    return Path(dirs[-1]) if dirs else None
