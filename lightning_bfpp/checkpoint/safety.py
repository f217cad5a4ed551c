"""Reading checkpoint files without running code. Every file bfpp loads (meta.pt, DCP's .metadata, the
.distcp shards, a plain exported file) goes through here: torch.load(weights_only=True), and a DCP reader whose
.metadata unpickler admits only DCP's own metadata classes. Anything else is refused, naming the file, unless
the user trusts the source (BFPPStrategy(trust_checkpoints=True) or BFPP_TRUST_CHECKPOINTS=1)."""
from __future__ import annotations

import dataclasses
import enum
import io
import os
import pathlib
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._private.torch_api import checkpoint_metadata_globals
from .errors import CheckpointError, read_error

TRUST_ENV = "BFPP_TRUST_CHECKPOINTS"
DCP_METADATA = ".metadata"


class UnsafeCheckpointError(CheckpointError):
    """A file whose unpickling would need more than plain data and tensors: refused unless trusted."""


def trusted(flag: bool = False) -> bool:
    """True when the user opted in to unrestricted unpickling (the flag, or BFPP_TRUST_CHECKPOINTS=1)."""
    return bool(flag) or os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


def refused(file: Path | str, detail: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{file}: refused to load: {detail}. A checkpoint written by lightning-bfpp never needs that: this file is "
        "not one bfpp wrote, or it was modified, and it may be malicious (unpickling it could run code). If you "
        f"trust its source: BFPPStrategy(trust_checkpoints=True) or the environment variable {TRUST_ENV}=1 "
        "(export: python -m lightning_bfpp.checkpoint --trust). If it is your own type in hyper-parameters or "
        "callback state: torch.serialization.add_safe_globals([YourType]) before loading."
    )


def _needs(error: BaseException) -> str:
    """What a refused unpickling asked for, from torch's weights_only message (or ours)."""
    found = re.findall(r"GLOBAL ([\w.]+)", str(error))
    if found:
        return f"it needs {found[0]} (outside the allowed plain data and tensor types)"
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"it holds something outside the allowed plain data and tensor types ({lines[-1] if lines else error})"


def load_file(file: Path, trust: bool = False, **kwargs: Any) -> Any:
    """torch.load one file (meta.pt, an exported or plain Lightning file) with weights_only unless trusted."""
    try:
        return torch.load(file, weights_only=not trust, **kwargs)
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower() or "GLOBAL" in str(e):
            raise refused(file, _needs(e)) from None
        raise CheckpointError(f"{file}: not a readable torch file ({e}); it is damaged or truncated.") from None
    except OSError as e:  # a permission, a file gone: what the storage says, not "damaged"
        raise read_error(file, e, Path(file).parent) from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{file}: not a readable torch file ({type(e).__name__}: {e}); it is damaged or "
                              "truncated.") from None


# ---- DCP metadata: an allowlist of DCP's own classes, torch sizes/dtypes/layouts, paths, plain containers ----
def _allowed_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {}
    for name, obj in vars(dcp_metadata).items():  # Metadata, TensorStorageMetadata, ..., _MEM_FORMAT_ENCODING
        if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__ and (
            dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
        ):
            allowed[(dcp_metadata.__name__, name)] = obj
    allowed[("torch", "Size")] = torch.Size
    allowed.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    allowed.update(checkpoint_metadata_globals())  # private names the metadata pickles contain
    allowed[("collections", "OrderedDict")] = OrderedDict
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = cls  # StorageMeta.checkpoint_id; constructing a path does no I/O
    return allowed


_ALLOWED = _allowed_globals()


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}") from None


def read_dcp_metadata(folder: Path, trust: bool = False, rank: int | None = None) -> Metadata:
    """Unpickle a DCP `.metadata` file allowing only DCP's metadata classes (anything, when trusted)."""
    file = Path(folder) / (DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}")
    try:
        f = open(file, "rb")  # closed by the with below
    except OSError as e:
        raise read_error(file, e, Path(folder)) from None
    with f:
        try:
            metadata = pickle.load(f) if trust else _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            if str(e).startswith("GLOBAL "):
                raise refused(file, _needs(e)) from None
            raise CheckpointError(f"{file}: not readable DCP metadata ({e}); it is damaged or truncated.") from None
        except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
            raise CheckpointError(f"{file}: not readable DCP metadata ({type(e).__name__}: {e}); it is damaged or "
                                  "truncated.") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP metadata: not a checkpoint bfpp "
                              "wrote.")
    return metadata


class SafeReader(FileSystemReader):
    """torch's FileSystemReader with `.metadata` read through the allowlist above, and every shard read one file
    at a time so that a refused or unreadable item names its `.distcp` file."""

    def __init__(self, path: str | os.PathLike, trust: bool = False) -> None:
        super().__init__(path)
        self.trust = trust

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self.path), self.trust, kwargs.get("rank"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            file = Path(self.path) / relative_path
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except pickle.UnpicklingError as e:
                raise refused(file, _needs(e)) from None
            except OSError as e:
                raise read_error(file, e, Path(self.path)) from None
            except Exception as e:
                raise CheckpointError(f"{file}: could not be read ({type(e).__name__}: {e}); it is damaged or "
                                      "truncated.") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor items (optimizer hyper-parameters, ...) are checked with
    torch.load(weights_only=True) first: torch's own load_bytes unpickles them with weights_only=False."""

    def __init__(self, trust: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trust = trust

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if not self.trust:
            safe = torch.load(value, weights_only=True)  # UnpicklingError on anything but plain data / tensors
            value = io.BytesIO()
            torch.save(safe, value)  # torch's unrestricted load below then only ever sees our own serialization
            value.seek(0)
        super().load_bytes(read_item, value)
