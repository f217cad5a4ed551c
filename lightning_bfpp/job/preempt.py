"""A stop signal with on_signal="save": every rank saves one checkpoint at the step boundary the ranks agreed
on through the job's store (``watchdog``), then the run ends as Lightning ends a signalled run (SIGTERMException),
and the process exits with the signal's code. Where that checkpoint goes, how long it may take, and what resumes it."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

ON_SIGNAL = ("save", "exit")
GRACE_S = 60.0  # the save's bound where no scheduler says otherwise
TORCHRUN_GRACE_S = 25.0  # torchrun SIGKILLs its workers 30 s after passing its SIGTERM on
SLURM_TERM_GRACE_S = 25.0  # SLURM's default KillWait: 30 s between SIGTERM and SIGKILL


class Preempted(SIGTERMException):
    """Raised on every rank at the agreed step boundary after the signal's checkpoint was saved; Lightning ends the
    run as after its own SIGTERM (callbacks' ``on_exception`` see it), then the process exits with 128 + `signum`."""

    def __init__(self, signum: int, step: int, path: Path | None) -> None:
        super().__init__(128 + signum)
        self.signum, self.step, self.path = signum, step, path

    def __str__(self) -> str:
        saved = f"saved {self.path}" if self.path else "nothing saved"
        return f"stopped by {signal.Signals(self.signum).name} at step {self.step} ({saved})"


def check_on_signal(on_signal: str, grace_s: float | None) -> None:
    if on_signal not in ON_SIGNAL:
        raise ValueError(f"on_signal={on_signal!r}: use 'save' (a checkpoint at the next step boundary, then exit) or "
                         "'exit' (exit at once).")
    if grace_s is not None and not grace_s > 0:
        raise ValueError(f"signal_grace_s={grace_s!r} must be a positive number of seconds (None: see "
                         "lightning_bfpp.job.preempt.default_grace_s).")


def default_grace_s(signum: int, environment: ClusterEnvironment | None, requeue_signal: int | None) -> float:
    """Seconds the save on `signum` may take before the job exits without it: what the launcher leaves before it kills
    (torchrun: 30 s; SLURM after SIGTERM: KillWait, 30 s by default), else ``GRACE_S`` (SLURM's requeue signal comes
    as early as ``#SBATCH --signal=USR1@<seconds>`` says)."""
    if isinstance(environment, SLURMEnvironment) and signum != requeue_signal:
        return SLURM_TERM_GRACE_S
    if os.environ.get("TORCHELASTIC_RUN_ID") and not isinstance(environment, SLURMEnvironment):
        return TORCHRUN_GRACE_S
    return GRACE_S


def signal_checkpoint_path(trainer, given: str | os.PathLike | None) -> tuple[Path, str]:
    """(where the signal's checkpoint goes, how a restart resumes it): `given`; under SLURM or without a
    ModelCheckpoint, Lightning's HPC checkpoint in ``default_root_dir`` (a SLURM requeue resumes it by itself);
    else ``last.ckpt`` in the ModelCheckpoint's folder (``ckpt_path="last"``)."""
    if given is not None:
        return Path(given), f"ckpt_path={given}"
    callback = trainer.checkpoint_callback
    slurm = isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)
    if slurm or not isinstance(callback, ModelCheckpoint) or not callback.dirpath:
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        how = "the requeued job resumes it by itself" if slurm else 'ckpt_path="hpc"'
        return Path(path), how
    return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}", 'ckpt_path="last"'


def saved_at(path: Path, step: int) -> bool:
    """Whether `path` is a complete bfpp checkpoint of global step `step` (names and sizes, no hashing)."""
    from ..checkpoint.manifest import quick_complete

    found = quick_complete(path) if path.is_dir() else None
    return found is not None and found[0] == step


class SaveOnSignal(Callback):
    """Added by the strategy when fitting with on_signal="save". After each optimizer step (after the user's
    callbacks, ModelCheckpoint included) it asks the job (``JobGuard.save_requested``) whether a signal asked for a
    save at this step; every rank gets the same answer at the same step, saves, and raises ``Preempted``."""

    def __init__(self, job, path: str | os.PathLike | None) -> None:
        self.job, self.path = job, path
        self._seen_step = -1

    def on_train_batch_end(self, trainer, *args) -> None:
        step = trainer.global_step
        if step == self._seen_step:  # accumulating: not an optimizer step boundary
            return
        self._seen_step = step
        signum = self.job.save_requested(step)
        if signum is None:
            return
        path, how = signal_checkpoint_path(trainer, self.path)
        if not saved_at(path, step):  # e.g. a ModelCheckpoint's last.ckpt of this very step
            trainer.save_checkpoint(path, weights_only=False)  # the whole state (no line from Lightning)
        stop = self.job.saved_on_signal(signum, step, path)
        trainer.strategy.barrier("bfpp_saved_on_signal")  # every rank has said why before any rank can exit
        rank_zero_info(f"bfpp: saved {path} at step {step} on {signal.Signals(signum).name}; resume: {how}")
        raise stop
