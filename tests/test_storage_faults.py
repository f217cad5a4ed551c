"""Storage faults as a user meets them: a full disk at the first save, at a later save and during a background save
(async_save=True), a checkpoint directory that is not writable, and a checkpoint that cannot be read on resume.

For each: every rank's first line names the cause (the errno's meaning, the path, the sizes, the setting that helps),
every process is gone within seconds of the error (printed: `pytest -s`), no partial folder is left, and the rerun from
the newest complete checkpoint ends where an uninterrupted run does. The full disk is a checkpoint folder
with a quota everywhere (tests/full_disk.py: bfpp's FileSystemWriter subclass raising ENOSPC once the folder would
pass N bytes), and a real small tmpfs where the machine lets a test mount one (else skipped, saying why). Root ignores
permission bits: its launches run without CAP_DAC_OVERRIDE (setpriv), so that they apply as to any other user."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from app import run_dir as rundir
from exact_compare import assert_exact
from full_disk import limited
from launch import clean_env, merged, run_lightning, start_lightning, start_torchrun

import lightning_bfpp.checkpoint as ckpt
from lightning_bfpp.checkpoint.errors import size_text
from lightning_bfpp.job.liveness import pid_alive
from lightning_bfpp.job.watchdog import Watchdog

WORLD = 2
BUDGET_S = 60  # every process gone within this many seconds of the error, as in test_failures (measured: printed)
STEPS, EVERY = 4, 2
BASE = {"pp": 2, "loops": 1, "m": 2, "steps": STEPS, "save_every": EVERY}
SAVE_BYTES = 460_000  # one save of StackNet at pp=2 (torch 2.13: 445 KiB; .metadata, two shards, meta.pt, manifest)
FULL = {  # a full disk: the run's own settings, and the step whose save fails
    "first": ({"disk_quota": SAVE_BYTES // 4}, 2),
    "later": ({"disk_quota": SAVE_BYTES * 3 // 2}, 4),
    # in the background: the failure is raised at the first step boundary after it (steps of 0.5 s, longer than the
    # write), before the next save and the end of training
    "async": ({"disk_quota": SAVE_BYTES * 3 // 2, "async_save": True, "steps": 2 * STEPS, "step_sleep": 0.5}, 4),
}
SAID = re.compile(r"\[rank (\d+)\] bfpp: (.*)")
NO_ROOT_BYPASS = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                  "--bounding-set=-dac_override,-dac_read_search"]


def mount_small_disk(folder: Path, size: int) -> None:
    """A tmpfs of `size` bytes at `folder`, or the test is skipped with the machine's reason."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command: a small filesystem cannot be mounted here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"this machine refuses to mount a small filesystem (mount needs root): {done.stderr.strip()}")


def as_a_user() -> list[str]:
    """A command prefix under which permission bits apply to this process (root's would be ignored)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None or subprocess.run([*NO_ROOT_BYPASS, "true"]).returncode != 0:
        pytest.skip("running as root, and setpriv cannot drop CAP_DAC_OVERRIDE here: permission bits do not apply")
    return NO_ROOT_BYPASS


@dataclass
class Fault:
    """A failed launch: its output, the exit status, seconds from the error to every process gone, its save folder."""

    output: str
    returncode: int
    gone_s: float
    save_dir: Path

    def first_lines(self) -> dict[int, str]:
        """Each rank's first `[rank R] bfpp:` line."""
        first: dict[int, str] = {}
        for m in SAID.finditer(self.output):
            first.setdefault(int(m[1]), m[2])
        return first


def _launch_failing(tmp: Path, cfg: dict, start=start_lightning, prefix: list[str] | None = None) -> Fault:
    pids = tmp / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    proc = start(tmp / "out", WORLD, [{**cfg, "pid_dir": str(pids)}], prefix=prefix or [])
    output = proc.communicate(timeout=400)[0]  # every process has closed the shared pipe: all gone
    ended = time.time()
    ranks = [int(p.read_text()) for p in pids.glob("rank*")]
    assert not [pid for pid in ranks if pid_alive(pid)], output[-3000:]
    errors = [p.stat().st_mtime for p in pids.glob("exception*")]  # when each rank's run raised (its on_exception)
    assert errors, output[-3000:]
    return Fault(output, proc.returncode, ended - min(errors), Path(cfg["save_dir"]))


class Faults:
    """The module's failed launches, each made when a test first asks for it."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory, self.done, self.mounted = factory, {}, []

    def __call__(self, name: str) -> Fault:
        if name not in self.done:
            tmp = self.factory.mktemp(f"fault-{name}")
            save_dir = tmp / "ck"
            if name in FULL:
                fault = _launch_failing(tmp, {**BASE, **FULL[name][0], "save_dir": str(save_dir)})
            elif name == "tmpfs":  # the real thing: a filesystem of 1.5 saves, "later" again
                mount_small_disk(save_dir, SAVE_BYTES * 3 // 2)
                self.mounted.append(save_dir)
                fault = _launch_failing(tmp, {**BASE, "save_dir": str(save_dir)})
                subprocess.run(["mount", "-o", "remount,size=16m", str(save_dir)], check=True)  # space freed
            elif name == "unwritable":
                prefix = as_a_user()
                save_dir.mkdir()
                save_dir.chmod(0o555)
                try:
                    fault = _launch_failing(tmp, {**BASE, "save_dir": str(save_dir)}, prefix=prefix)
                finally:
                    save_dir.chmod(0o755)
            else:  # "unreadable": the later fault's complete checkpoint, one shard unreadable, resumed under torchrun
                prefix = as_a_user()
                folder = save_dir / f"step={EVERY}.ckpt"
                shutil.copytree(self("later").save_dir / folder.name, folder)
                (folder / "__1_0.distcp").chmod(0)
                try:
                    fault = _launch_failing(tmp, {**BASE, "save_dir": str(save_dir), "resume": str(folder)},
                                            start=start_torchrun, prefix=prefix)
                finally:
                    (folder / "__1_0.distcp").chmod(0o644)
            print(f"\n{name}: every process gone {fault.gone_s:.1f} s after the error (exit {fault.returncode})")
            self.done[name] = fault
        return self.done[name]


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> Faults:
    made = Faults(tmp_path_factory)
    yield made
    for folder in made.mounted:
        subprocess.run(["umount", "-l", str(folder)])


@pytest.fixture(scope="module")
def reruns(faults, tmp_path_factory) -> dict[str, list[dict]]:
    """One launch after the faults were fixed (space freed, permissions back): an uninterrupted run (into the folder
    that was not writable), and each fault's run resumed from the newest complete checkpoint, as ckpt_path=auto picks
    it (none after a full disk at the first save: it starts over)."""
    configs = {"reference": {**BASE, "save_dir": str(faults("unwritable").save_dir)}}
    for name in [*FULL, "unreadable", "tmpfs"]:
        try:
            folder = faults(name).save_dir
        except pytest.skip.Exception:  # no small filesystem here: its test says why
            continue
        newest, _ = ckpt.newest_to_resume(folder)
        configs[name] = {**BASE, "save_dir": str(folder), "resume": str(newest) if newest else None}
    out = tmp_path_factory.mktemp("reruns")
    records = run_lightning(out, WORLD, list(configs.values()))
    return {"resumed from": {k: c.get("resume") for k, c in configs.items()}, **dict(zip(configs, records))}


def _names_the_full_disk(fault: Fault, step: int) -> None:
    first = fault.first_lines()
    assert sorted(first) == list(range(WORLD)), fault.output[-3000:]
    for rank, line in first.items():
        assert line.startswith(f"the job stops because saving {fault.save_dir}/step={step}.ckpt failed: No space left "
                               "on device (ENOSPC) on rank "), (rank, line)
        assert re.search(r"this save needs about [\d.]+ KiB, [\d.]+ KiB free there", line), line
        assert "keep fewer checkpoints (ModelCheckpoint(save_top_k=N))" in line
        assert "did not reach step" not in line
    assert fault.output.index("bfpp: the job stops because") < fault.output.find("Traceback") % len(fault.output)


@pytest.mark.parametrize("name", list(FULL))
def test_a_full_disk_is_named_on_every_rank_and_leaves_no_partial_save(faults, name):
    fault, (settings, step) = faults(name), FULL[name]
    assert fault.returncode != 0 and fault.gone_s < BUDGET_S, fault.gone_s
    _names_the_full_disk(fault, step)
    assert not list(fault.save_dir.glob(".*.tmp-*")), list(fault.save_dir.iterdir())
    newest, _ = ckpt.newest_to_resume(fault.save_dir)  # the save before the failed one stays the newest complete
    assert newest == (fault.save_dir / f"step={step - EVERY}.ckpt" if step > EVERY else None)
    warned = fault.output.count("a save will soon fail for want of space")
    assert warned == (1 if step > EVERY else 0), fault.output[-3000:]  # after a first save, below 2 saves: once
    # each rank's global step when its run raised: the failed save's (a background save's: a step boundary after it)
    raised_at = {int(p.read_text().split()[0]) for p in fault.save_dir.parent.glob("pids/exception*")}
    assert raised_at <= ({step, step + 1} if settings.get("async_save") else {step}), raised_at


def test_an_unwritable_checkpoint_folder_is_refused_before_training(faults):
    fault = faults("unwritable")
    assert fault.returncode != 0 and fault.gone_s < BUDGET_S, fault.gone_s
    assert fault.first_lines() == {0: f"the job stops because checkpoints cannot be written to {fault.save_dir} "
                                      "(ModelCheckpoint(dirpath=...)): Permission denied (EACCES). Fix: make it "
                                      "writable for this user, or set ModelCheckpoint(dirpath=...) to a directory you "
                                      "can write to."}
    assert "Initializing distributed: GLOBAL_RANK: 1" not in fault.output  # refused before rank 1 started
    assert list(fault.save_dir.iterdir()) == []


def test_an_unreadable_checkpoint_on_resume_is_named_with_the_fix(faults):
    fault = faults("unreadable")
    assert fault.returncode != 0 and fault.gone_s < BUDGET_S, fault.gone_s
    shard = fault.save_dir / f"step={EVERY}.ckpt" / "__1_0.distcp"
    first = fault.first_lines()
    assert sorted(first) == list(range(WORLD)), fault.output[-3000:]
    for line in first.values():  # under torchrun every rank checks the checkpoint as it loads
        assert line.startswith(f"the job stops because reading {shard} failed: Permission denied (EACCES). Fix: make "
                               "the checkpoint readable for this user (e.g. chmod -R u+rX "), line


def test_a_real_full_filesystem_is_named_on_every_rank_and_leaves_no_partial_save(faults):
    """A tmpfs of 1.5 saves: the first save fits, the second fills it (torch's own error there is `unexpected pos N vs
    M`: the OSError behind it is what bfpp reports)."""
    fault = faults("tmpfs")
    assert fault.returncode != 0 and fault.gone_s < BUDGET_S, fault.gone_s
    _names_the_full_disk(fault, 2 * EVERY)
    assert "unexpected pos" not in "".join(fault.first_lines().values())
    assert sorted(p.name for p in fault.save_dir.iterdir()) == [f"step={EVERY}.ckpt"]  # no partial save left
    assert fault.output.count("a save will soon fail for want of space") == 1


@pytest.mark.parametrize("name", [*FULL, "unreadable", "tmpfs"])
def test_the_rerun_resumes_from_the_newest_complete_checkpoint_exactly(reruns, name):
    if name not in reruns:
        pytest.skip("no small filesystem on this machine (see the test above)")
    got, want = reruns[name], reruns["reference"]
    start = 0 if name == "first" else EVERY  # the step it resumed from
    assert (reruns["resumed from"][name] is None) == (start == 0)
    assert all(r["losses"] == got[0]["losses"] for r in got)
    assert_exact(got[0]["losses"], want[0]["losses"][start:], "train_loss")
    assert_exact(merged(got), merged(want), "params")


# ---- one process, no launch -------------------------------------------------------------------------------------
def _save_steps(folder: Path, steps: range, storage: ckpt.Storage) -> None:
    for step in steps:
        ckpt.save(folder / f"step={step}.ckpt", {"state_dict": {"w": torch.arange(20_000.0) + step}},
                  {"global_step": step}, storage=storage)


def _one_save_bytes(tmp: Path) -> int:
    storage = ckpt.Storage()
    _save_steps(tmp / "measure", range(1, 2), storage)
    return storage.last_bytes


@pytest.mark.parametrize("disk", ["quota", "tmpfs"])
def test_a_full_disk_in_one_process_warns_once_then_names_the_cause(tmp_path, disk):
    """Room for 2.5 saves: the first two fit (the second warned about, once: below two saves left), the third fails
    with the cause in one line, its partial folder removed, the second still the newest complete checkpoint."""
    size = _one_save_bytes(tmp_path)
    folder, storage = tmp_path / "disk", ckpt.Storage()
    room = size * 5 // 2 + 4096 * 8  # (a tmpfs counts whole 4 KiB pages per file)
    if disk == "tmpfs":
        mount_small_disk(folder, room)
    try:
        with limited(folder, room) if disk == "quota" else contextlib.nullcontext():
            _save_steps(folder, range(1, 2), storage)
            with pytest.warns(UserWarning, match=r"free in .*disk, less than 2 saves of .*: a save will soon fail"):
                _save_steps(folder, range(2, 3), storage)
            with pytest.raises(ckpt.StorageError) as failed:
                _save_steps(folder, range(3, 4), storage)
        text = str(failed.value)
        assert "\n" not in text and text.startswith(f"saving {folder}/step=3.ckpt failed: No space left on device "
                                                    f"(ENOSPC) on rank 0 writing {folder}/.step=3.ckpt.tmp-")
        assert f"the last complete save took {size_text(size)}" in text and "unexpected pos" not in text
        assert f"The newest complete checkpoint in {folder}: {folder}/step=2.ckpt" in text
        assert sorted(p.name for p in folder.iterdir()) == ["step=1.ckpt", "step=2.ckpt"]
        ckpt.check_path(folder / "step=2.ckpt")
    finally:
        if disk == "tmpfs":
            subprocess.run(["umount", "-l", str(folder)])


def test_partial_saves_left_by_a_killed_process_are_removed_at_the_start_of_the_next(tmp_path):
    """The app, its run directory's lock held: every hidden folder of an interrupted save is dealt with at once, and
    said; a complete checkpoint is never removed (one whose rename was interrupted takes its name back)."""
    run_dir, storage = tmp_path / "run", ckpt.Storage()
    checkpoints = run_dir / "checkpoints"
    _save_steps(checkpoints, range(1, 3), storage)
    partial = checkpoints / ".step=3.ckpt.tmp-0badc0de"  # killed mid-write
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    (checkpoints / "step=2.ckpt").rename(checkpoints / ".step=2.ckpt.tmp-1234abcd")  # killed between the renames
    shutil.copytree(checkpoints / "step=1.ckpt", checkpoints / ".step=1.ckpt.tmp-feed0000-replaced")  # the old one
    left = checkpoints / ".step=1.ckpt.tmp-5555aaaa"  # complete, killed before its rename: its name is taken
    shutil.copytree(checkpoints / "step=1.ckpt", left)
    signal_save = run_dir / ".hpc-ckpt-1.ckpt.tmp-77777777"  # a save on a signal (default_root_dir), killed
    signal_save.mkdir()
    lines = rundir.remove_partial_saves(run_dir)
    assert sorted(p.name for p in checkpoints.iterdir()) == [left.name, "step=1.ckpt", "step=2.ckpt"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]
    ckpt.check_path(checkpoints / "step=2.ckpt")
    said = "\n".join(lines)
    assert f"removed {partial} (7 B): the partial checkpoint of an interrupted save" in said
    assert f"removed {signal_save} (0 B): the partial checkpoint of an interrupted save" in said
    assert f"restored {checkpoints / 'step=2.ckpt'}: a complete checkpoint whose save was interrupted" in said
    assert f"removed {checkpoints / '.step=1.ckpt.tmp-feed0000-replaced'} (" in said
    assert f"left {left}: a complete checkpoint that did not take its name" in said
    assert len(lines) == 5, lines
    assert rundir.remove_partial_saves(run_dir) == [f"left {left}: a complete checkpoint that did not take its name "
                                                    "(rename it to use it)"]


UNREADABLE = """
import sys
from pathlib import Path
import lightning_bfpp.checkpoint as ckpt
folder = Path(sys.argv[1])
for what, call in (("resume", lambda: ckpt.newest_to_resume(folder)),
                   ("check", lambda: ckpt.check_path(folder / "step=3.ckpt"))):
    try:
        call()
        print(what, "passed")
    except ckpt.StorageError as e:
        print(what, e)
"""


def test_a_checkpoint_that_cannot_be_read_is_named_never_passed_over(tmp_path):
    """ckpt_path=auto never falls back to an older checkpoint past one it cannot read (it may be newer), and a shard
    that cannot be read is named before any process starts, with the fix."""
    folder = tmp_path / "ck"
    _save_steps(folder, range(1, 4), ckpt.Storage())
    (folder / "step=2.ckpt" / "manifest.json").chmod(0)
    (folder / "step=3.ckpt" / "__0_0.distcp").chmod(0)
    done = subprocess.run([*as_a_user(), sys.executable, "-c", UNREADABLE, str(folder)], capture_output=True,
                          text=True, env=clean_env(), timeout=120)
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert said["resume"].startswith(f"{folder}/step=2.ckpt cannot be read (Permission denied: {folder}/step=2.ckpt/"
                                     "manifest.json), and it may be the newest checkpoint in"), done.stderr[-3000:]
    assert said["check"].startswith(f"reading {folder}/step=3.ckpt/__0_0.distcp failed: Permission denied (EACCES). "
                                    f"Fix: make the checkpoint readable for this user (e.g. chmod -R u+rX "
                                    f"{folder}/step=3.ckpt)"), said["check"]


def test_only_a_failed_wait_names_the_ranks_behind_and_a_shared_failure_blames_none():
    """The issue's run said `rank 0 did not reach step 9 like the others (stuck or much slower)` after a full disk:
    step counts published a second apart are not a rank behind. A failure every rank shares names no rank."""
    behind = "; rank 0 did not reach step 9 like the others (stuck or much slower)"
    watchdog = SimpleNamespace(rank=1, _laggards=lambda: behind)
    shared = ckpt.StorageError("saving x failed: No space left on device (ENOSPC) on rank 0 writing y")
    assert Watchdog._reason(watchdog, shared, str(shared)) == str(shared)
    assert Watchdog._reason(watchdog, RuntimeError("boom"), "boom") == "rank 1 failed: RuntimeError: boom"
    waited = dist.DistError("wait timed out after 10 s")
    assert Watchdog._reason(watchdog, waited, str(waited)) == f"rank 1 failed: DistError: {waited}{behind}"
