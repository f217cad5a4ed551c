"""Loading never runs code from a checkpoint, and a checkpoint that is damaged, incomplete, missing or of another
model fails naming the file (and the newest complete checkpoint next to it). Most tests run in this process on
folders written by `checkpoint.save`; the command-line and multi-process paths are checked once each."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from exact_model import StackNet
from launch import ROOT, SCRIPT, clean_env
from procenv import free_port
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import lightning_bfpp.checkpoint as ckpt
from lightning_bfpp.checkpoint.manifest import MANIFEST
from lightning_bfpp.checkpoint.partial import QUIET_S
from lightning_bfpp.checkpoint.safety import read_dcp_metadata

TRAIN = ROOT / "examples" / "train.py"


class Payload:
    """Unpickling this runs `touch marker` (what an attacker would put in a checkpoint)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def _save(folder: Path, opt: str = "sgd", n_blocks: int = 6) -> StackNet:
    """A checkpoint folder as the strategy writes it (one process): weights, flattened optimizer state, meta."""
    torch.manual_seed(0)
    model = StackNet(n_blocks=n_blocks, opt=opt)
    optim = (torch.optim.AdamW if opt == "adamw" else torch.optim.SGD)(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).sum().backward()
    optim.step()
    state = {"state_dict": model.state_dict(), "optimizer_0": ckpt.optimizer_state(model, optim)}
    ckpt.save(folder, state, {"epoch": 0, "global_step": int(folder.name.split("-")[-1].split(".")[0]),
                              "hyper_parameters": dict(model.hparams)})
    return model


def _fresh(opt: str = "sgd", n_blocks: int = 6) -> tuple[StackNet, list[torch.optim.Optimizer]]:
    torch.manual_seed(1)
    model = StackNet(n_blocks=n_blocks, opt=opt)
    optim = (torch.optim.AdamW if opt == "adamw" else torch.optim.SGD)(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).sum().backward()
    optim.step()  # optimizer state exists, so loading has something to overwrite
    return model, [optim]


def _rehash(folder: Path) -> None:
    """Update the manifest as a careful attacker would, so that only the safe reading stands in the way."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for name in manifest["files"]:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def plant(folder: Path, where: str, marker: Path) -> Path:
    """Put a code-running pickle into one file of a checkpoint folder; return that file."""
    if where == "meta":
        torch.save({"epoch": 0, "global_step": Payload(marker)}, folder / ckpt.META_FILE)
        file = folder / ckpt.META_FILE
    elif where == "metadata":
        (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        file = folder / ".metadata"
    else:  # a shard item (non-tensor "bytes" or a tensor) re-pointed at a payload appended to its .distcp file
        metadata = read_dcp_metadata(folder)
        is_bytes = where == "distcp-bytes"
        key = next(k for k, v in metadata.state_dict_metadata.items() if (  # the first layer's (rank 0 reads it)
            isinstance(v, BytesStorageMetadata) and k.startswith("optimizer_0.param_groups.") if is_bytes
            else not isinstance(v, BytesStorageMetadata) and k.startswith("state_dict.")))
        index = next(i for i in metadata.storage_data if i.fqn == key)
        info = metadata.storage_data[index]
        file = folder / info.relative_path
        buf = io.BytesIO()
        torch.save(Payload(marker), buf)
        offset = file.stat().st_size
        with open(file, "ab") as f:
            f.write(buf.getvalue())
        metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(folder)
    return file


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WHERE = ["meta", "metadata", "distcp-bytes", "distcp-tensor"]


@pytest.mark.parametrize("where", WHERE)
def test_planted_pickle_never_runs(tmp_path, where):
    folder, marker = tmp_path / "run" / "step-1.ckpt", tmp_path / "marker"
    _save(folder)
    file = plant(folder, where, marker)
    before = _snapshot(tmp_path / "run")
    with pytest.raises(ckpt.UnsafeCheckpointError, match=re.escape(str(file))) as err:
        ckpt.check_path(folder) if where in ("meta", "metadata") else None  # read before any process starts
        ckpt.load(folder, *_fresh())
    assert "not one bfpp wrote" in str(err.value) and "trust_checkpoints=True" in str(err.value)
    if where == "distcp-bytes":  # export reads the weights only, never the optimizer's items
        ckpt.export(folder, tmp_path / "out.ckpt")
    else:
        with pytest.raises(ckpt.UnsafeCheckpointError, match=re.escape(str(file))):
            ckpt.export(folder, tmp_path / "out.ckpt")
        assert not (tmp_path / "out.ckpt").exists()
    assert not marker.exists()
    assert _snapshot(tmp_path / "run") == before
    if where != "distcp-tensor":  # control: the plant does run code when trusted (torch reads tensors safely anyway)
        with pytest.raises(Exception):  # noqa: B017 - whatever the payload's result breaks afterwards
            ckpt.load(folder, *_fresh(), trust=True)
            raise AssertionError("loaded")
        assert marker.exists()


def test_planted_plain_file_and_export_cli(tmp_path):
    """A plain file with a payload is refused (pre-launch check and load); the export command exits non-zero
    naming the file, writes nothing, and prints no runpy warning when it works."""
    marker, plain = tmp_path / "marker", tmp_path / "plain.ckpt"
    torch.save({"state_dict": StackNet().state_dict(), "hyper_parameters": Payload(marker)}, plain)
    for call in (lambda: ckpt.check_path(plain), lambda: ckpt.load(plain, *_fresh())):
        with pytest.raises(ckpt.UnsafeCheckpointError, match=re.escape(str(plain))):
            call()
    good, bad = tmp_path / "good" / "step-2.ckpt", tmp_path / "bad" / "step-2.ckpt"
    _save(good)
    shutil.copytree(good, bad)
    file = plant(bad, "distcp-tensor", marker)
    with pytest.raises(SystemExit, match=re.escape(f"error: {file}: refused to load")):  # the command's main()
        ckpt.main([str(bad), str(tmp_path / "bad.ckpt")])
    assert not marker.exists() and not (tmp_path / "bad.ckpt").exists()
    cmd = [sys.executable, "-m", "lightning_bfpp.checkpoint"]
    r = subprocess.run(cmd + [str(good), str(tmp_path / "good.ckpt")], capture_output=True, text=True, env=clean_env())
    assert r.returncode == 0 and "RuntimeWarning" not in r.stderr, r.stderr[-2000:]
    exported = torch.load(tmp_path / "good.ckpt", weights_only=True)
    model = StackNet()
    model.load_state_dict(exported["state_dict"], strict=True)
    # the export as fit's ckpt_path: weights load, the optimizer and LR schedule start fresh (Lightning needs the key)
    with pytest.warns(UserWarning, match="weights only"):
        meta = ckpt.load(tmp_path / "good.ckpt", *_fresh())
    assert meta["lr_schedulers"] == [] and "loops" not in meta


def _two_checkpoints(tmp_path) -> tuple[Path, Path]:
    older, newer = tmp_path / "ck" / "step-1.ckpt", tmp_path / "ck" / "step-2.ckpt"
    _save(older)
    _save(newer)
    return older, newer


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete-shard", "delete-metadata"])
def test_damaged_checkpoint_names_the_file_and_the_newest_complete_one(tmp_path, damage):
    older, newer = _two_checkpoints(tmp_path)
    shard = newer / "__0_0.distcp"
    if damage == "flip":  # same size: only the checksum sees it
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:4096])
    else:
        (shard if damage == "delete-shard" else newer / ".metadata").unlink()
    file = shard if damage != "delete-metadata" else newer / ".metadata"
    if damage != "flip":  # structural damage fails before any process would start
        with pytest.raises(ckpt.CheckpointError, match=re.escape(str(file))) as err:
            ckpt.check_path(newer)
        assert f"ckpt_path={older}" in str(err.value)
    with pytest.raises(ckpt.CheckpointError, match=re.escape(str(file))) as err:
        ckpt.load(newer, *_fresh())
    assert f"ckpt_path={older}" in str(err.value)
    if damage == "flip":
        assert "checksum mismatch" in str(err.value)


def test_missing_path_and_folder_of_checkpoints(tmp_path):
    older, newer = _two_checkpoints(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=r"step-9.ckpt' does not exist.*newest complete checkpoint.*step-2"):
        ckpt.check_path(tmp_path / "ck" / "step-9.ckpt")
    with pytest.raises(ckpt.CheckpointError, match=r"folder of checkpoints, not one.*step-2.ckpt"):
        ckpt.check_path(tmp_path / "ck")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ckpt.CheckpointError, match="not a readable torch file"):
        ckpt.check_path(tmp_path / "notes.txt")
    ckpt.check_path(newer)  # a good one passes; Lightning's own names are resolved later
    ckpt.check_path("last")


def test_another_model_fails_naming_the_differences_unless_partial(tmp_path):
    folder = tmp_path / "step-1.ckpt"
    saved = _save(folder, opt="adamw", n_blocks=4)
    with pytest.raises(ckpt.CheckpointError, match=r"not in this model: blocks.3.norm.weight") as err:
        ckpt.load(folder, *_fresh("adamw", n_blocks=3))
    assert "strict_loading = False" in str(err.value)
    with pytest.raises(ckpt.CheckpointError, match=r"missing in the checkpoint: blocks.4.norm.weight"):
        ckpt.load(folder, *_fresh("adamw", n_blocks=6))
    wide, optims = _fresh("adamw", n_blocks=4)
    wide.head = torch.nn.Linear(16, 7)  # another number of classes
    with pytest.raises(ckpt.CheckpointError,
                       match=r"different shapes: head.weight \(5, 16\) in the checkpoint vs \(7, 16\)"):
        ckpt.load(folder, wide, optims)
    head = wide.head.weight.detach().clone()
    with pytest.warns(UserWarning, match="strict_loading=False"):
        ckpt.load(folder, wide, optims, strict=False)
    assert torch.equal(wide.blocks[3].fc.weight, saved.blocks[3].fc.weight) and torch.equal(wide.head.weight, head)


def test_stale_tmp_folders_are_removed_by_the_next_save(tmp_path):
    stale, live = tmp_path / ".step-1.ckpt.tmp-0badc0de", tmp_path / ".step-1.ckpt.tmp-0000beef"
    for d in (stale, live):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"partial")
    old = time.time() - QUIET_S - 60
    for p in (stale, stale / "__0_0.distcp"):
        os.utime(p, (old, old))
    _save(tmp_path / "step-2.ckpt")
    assert not stale.exists() and live.exists()  # one written to recently may be a save under way


# ---- processes: the command line (Lightning's launcher) and the strategy under torchrun -------------------------
APP = ["cluster=cpu_2", "schedule.micro_batches=2", "data.batch_size=4", "trainer.max_steps=2",
       "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false", "data.max_bytes=400000"]


def _app(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TRAIN), *APP, *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_resume_refuses_planted_files_and_bad_paths(tmp_path):
    run = tmp_path / "run"
    r = _app(["logger=csv", "checkpoint.every_n_steps=1", f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    cks = run / "checkpoints"
    clean = tmp_path / "clean"
    shutil.copytree(cks / "step-2.ckpt", clean / "step-2.ckpt")
    marker = tmp_path / "marker"
    planted = {where: plant(cks / name, where, marker)
               for where, name in (("meta", "step-1.ckpt"), ("metadata", "step-2.ckpt"), ("distcp-bytes", "last.ckpt"))}
    before = _snapshot(run)
    cases = [  # (ckpt_path, extra settings, text the output must hold)
        (cks / "step-1.ckpt", ["logger=wandb"], str(planted["meta"])),  # the app reads the W&B id from meta.pt too
        (cks / "step-2.ckpt", ["logger=csv"], str(planted["metadata"])),
        (cks / "last.ckpt", ["logger=csv"], str(planted["distcp-bytes"])),  # refused by the ranks while loading
        (cks / "step-7.ckpt", ["logger=csv"], f"The newest complete checkpoint in {cks}"),
        # another model shape: named in the app's keys before launch (the strategy's own check: test_another_model_...)
        (clean / "step-2.ckpt", ["logger=csv", "model.n_layer=2"],
         "was trained with model.n_layer=4; this run has model.n_layer=2. Resume with the checkpoint's settings"),
    ]
    for i, (path, extra, expected) in enumerate(cases):
        t = time.perf_counter()
        r = _app([*extra, f"ckpt_path={path}", f"hydra.run.dir={tmp_path / f'resume{i}'}"], tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode != 0 and expected in out, (path, r.returncode, out[-3000:])
        assert not marker.exists()
        print(f"{path.name} {extra}: exit {r.returncode} after {time.perf_counter() - t:.1f} s")
    assert _snapshot(run) == before


@pytest.mark.slow
def test_strategy_resume_refuses_planted_files(tmp_path):
    """BFPPStrategy in Python: Lightning's launcher refuses a planted meta.pt before starting rank 1; under
    torchrun (no launcher) every rank refuses a planted shard item while loading."""
    marker = tmp_path / "marker"
    meta_ck, shard_ck = tmp_path / "a" / "step-3.ckpt", tmp_path / "b" / "step-3.ckpt"
    _save(meta_ck)
    _save(shard_ck)
    files = [plant(meta_ck, "meta", marker), plant(shard_ck, "distcp-bytes", marker)]
    cfg = lambda ck: json.dumps([{"pp": 2, "loops": 2, "m": 2, "steps": 4, "resume": str(ck)}])  # noqa: E731
    popen = [sys.executable, str(SCRIPT), str(tmp_path / "out0"), "2", cfg(meta_ck)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                f"--master_port={free_port()}", str(SCRIPT), str(tmp_path / "out1"), "2", cfg(shard_ck)]
    for cmd, file, env in ((popen, files[0], clean_env(MASTER_PORT=str(free_port()))),
                           (torchrun, files[1], clean_env())):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        out = r.stdout + r.stderr
        assert r.returncode != 0 and str(file) in out, out[-3000:]
        assert not marker.exists()
    for rank in (0, 1):  # under torchrun every rank names the file (rank 1 does not read it: rank 0 failed)
        assert f"[rank{rank}]: lightning_bfpp.checkpoint.safety.UnsafeCheckpointError: {files[1]}" in out, out[-3000:]


def test_param_group_settings_added_after_the_save_keep_their_values(tmp_path):
    """An LR scheduler made after the save adds `initial_lr` to the param groups (Lightning's lr_find saves, runs
    its own scheduler on the user's optimizer, then restores): the restore loads the saved lr and state and keeps
    `initial_lr`; another setting the checkpoint lacks is kept with a warning; missing optimizer state still fails."""
    folder = tmp_path / "step-1.ckpt"
    _save(folder, opt="adamw")
    plain, plain_optims = _fresh("adamw")
    ckpt.load(folder, plain, plain_optims)  # no scheduler: the reference restore
    model, optims = _fresh("adamw")
    torch.optim.lr_scheduler.LinearLR(optims[0], start_factor=0.5)  # lr 0.05, initial_lr 0.1
    ckpt.load(folder, model, optims)
    group = optims[0].param_groups[0]
    assert group["lr"] == 0.1 and group["initial_lr"] == 0.1
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(optims[0].state[p]["exp_avg"], plain_optims[0].state[q]["exp_avg"])
    model, optims = _fresh("adamw")
    optims[0].param_groups[0]["my_setting"] = 3
    with pytest.warns(UserWarning, match=r"param groups have my_setting, which the checkpoint does not"):
        ckpt.load(folder, model, optims)
    assert optims[0].param_groups[0]["my_setting"] == 3
    model, optims = _fresh("adamw")
    optims[0].state[next(model.parameters())]["extra"] = torch.zeros(1)  # state the checkpoint does not hold
    with pytest.raises(ckpt.CheckpointError, match=r"extra"):
        ckpt.load(folder, model, optims)


def test_export_names_an_output_it_cannot_write(tmp_path):
    folder = tmp_path / "step-1.ckpt"
    _save(folder)
    with pytest.raises(SystemExit, match=r"is a folder: give the file to write, e.g. .*model.ckpt"):
        ckpt.main([str(folder), str(tmp_path)])
    with pytest.raises(SystemExit, match=r"the folder .*nowhere does not exist; create it first"):
        ckpt.main([str(folder), str(tmp_path / "nowhere" / "model.ckpt")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1.ckpt"]  # nothing written
