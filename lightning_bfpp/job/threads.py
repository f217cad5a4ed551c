"""CPU threads per process: Lightning's rule on every rank. Lightning's launchers set torch's intra-op threads to
cores ÷ local processes unless ``OMP_NUM_THREADS`` is set, in the processes that run a launcher. Under
ModelParallelStrategy only the launching process runs one: its child ranks, and every rank under torchrun or SLURM,
kept torch's default (all the cores each), so the ranks of a node oversubscribed its cores. bfpp applies the rule on
every rank and says the number once."""
from __future__ import annotations

import os

import torch

from .._private.lightning_api import num_cpus_available, set_num_threads_if_needed

_RULE_SET_IT = False  # this process set OMP_NUM_THREADS by the rule (else it was set before the job started)


def apply_thread_rule(local_processes: int) -> None:
    """Lightning's rule in this process: torch's threads = cores ÷ `local_processes`, unless OMP_NUM_THREADS is
    set (by the user, or by a launcher such as torchrun, which sets 1)."""
    global _RULE_SET_IT
    if "OMP_NUM_THREADS" not in os.environ:
        set_num_threads_if_needed(num_processes=local_processes)
        _RULE_SET_IT = True


def threads_line(local_processes: int) -> str:
    """Apply the rule (``apply_thread_rule``); the line that says what this process runs with."""
    apply_thread_rule(local_processes)
    threads = torch.get_num_threads()
    each = f"bfpp: {threads} CPU thread{'s' if threads != 1 else ''} per process"
    if _RULE_SET_IT:
        processes = f"{local_processes} process{'es' if local_processes != 1 else ''}"
        return (f"{each} ({num_cpus_available()} cores / {processes} on this node, Lightning's rule; "
                "OMP_NUM_THREADS=N to choose)")
    return f"{each} (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, set before the job started)"
