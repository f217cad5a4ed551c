"""The private torch APIs lightning-bfpp uses outside torch.distributed.pipelining's schedule runtime (that one
is lightning_bfpp/_private/pipelining.py, and its per-call fast paths torch_fast_paths.py). Each entry says why it
is needed and which public alternative was checked (torch 2.13). Importing this module checks the installed torch
against the tested range (versions.SUPPORTED)."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from .versions import check_version

check_version("torch")


def default_store() -> dist.Store:
    """The key-value store of the default process group (the job's rendezvous store), which the watchdog uses to
    post failures and progress without a collective. Why private: torch exposes no getter for it.
    Public alternatives checked: a second ``dist.TCPStore`` (needs its own port and a rank-0 server the launchers
    do not set up); ``dist.init_process_group(store=...)`` (the process group is created by Lightning, not by us)."""
    return dist.distributed_c10d._get_default_store()


def set_default_group_timeout(timeout) -> None:
    """The default process group's timeout, and its store's, once the group exists (the rendezvous that created
    it may have waited longer, for every process to start). Why private: ``_set_pg_timeout`` is torch's only way
    to change a live group's timeout. Public alternatives checked: ``init_process_group(timeout=)`` (one value for
    the rendezvous and every later collective), ``new_group(timeout=)`` (Lightning's own collectives use the
    default group); ``Store.set_timeout`` is public."""
    dist.distributed_c10d._set_pg_timeout(timeout)
    default_store().set_timeout(timeout)


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `t`'s data: a DTensor's local part (``_local_tensor``), the result an
    ``AsyncCollectiveTensor`` wraps (``elem``: a tensor-parallel layer's output whose all-reduce is in flight, e.g. a
    row-wise split embedding's), else `t`. Why private: this runs inside saved-tensor hooks, where the public
    ``DTensor.to_local()`` would record an autograd op (and run the hooks again), and waiting for the collective
    would end its overlap. Public alternative checked: ``to_local()`` (used everywhere outside autograd hooks)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


def checkpoint_metadata_globals() -> dict[tuple[str, str], Any]:
    """Private globals that torch.distributed.checkpoint's metadata pickles name (``.metadata`` files), allowed by
    checkpoint/safety.py's restricted unpickler. Why private: the files contain these names; they are looked up,
    not called by us. Public alternative checked: ``torch.serialization.add_safe_globals`` (applies to
    ``torch.load``, not to DCP's ``pickle.load`` of the metadata)."""
    from torch.distributed.checkpoint import filesystem

    return {
        (filesystem.__name__, "_StorageInfo"): filesystem._StorageInfo,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a lookup by layout name
    }


def check_compile(device_type: str) -> None:
    """Raise naming the setting when torch.compile cannot compile layers for `device_type` here: dynamo unsupported
    on this Python / platform (``check_if_dynamo_supported``, private: torch's own reason), or no C++ compiler for
    inductor's CPU kernels. Public alternative checked: ``torch.compiler`` has no such check (a compile fails at the
    first step, inside the pipeline)."""
    import shutil

    from torch._dynamo.eval_frame import check_if_dynamo_supported

    try:
        check_if_dynamo_supported()
    except Exception as error:  # RuntimeError naming the Python version / platform
        raise RuntimeError(f"compile=True (Hydra: schedule.compile=true): torch.compile cannot run here ({error}); "
                           "set compile=False.") from None
    if device_type == "cpu":
        compilers = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
        if not any(shutil.which(c) for c in compilers):
            raise RuntimeError(f"compile=True (Hydra: schedule.compile=true) on CPU needs a C++ compiler for "
                               f"inductor's kernels; none of {compilers} is on PATH. Install one (e.g. `apt-get "
                               "install g++`, or set CXX) or set compile=False.")


def compiled_graph_count() -> int:
    """Graphs torch.compile has compiled in this process so far, recompiles included (dynamo's ``unique_graphs``
    counter). Why private: torch exposes no count; public alternative checked: ``TORCH_LOGS=recompiles`` (logs
    each one, countable only by parsing log lines)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def all_to_all_autograd(rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
                        group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of `rows` (dim 0 split into `input_splits`, one part per rank of `group`; `output_splits` rows
    received from each) whose backward sends the gradients back the same way: expert parallel's dispatch and combine.
    Why private: torch 2.13 deprecates the public ``torch.distributed.nn.functional.all_to_all_single`` (a
    FutureWarning at every call) in favour of ``_functional_collectives.all_to_all_single_autograd``, which torchtitan
    uses too. Public alternative checked: the deprecated one (the same result, uneven splits, on gloo too)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group))
