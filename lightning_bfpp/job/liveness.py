"""Whether the processes of a job's ranks on this host are still there: a local peer gone without having finished
was killed (SIGKILL, out of memory) or crashed."""
from __future__ import annotations

import os
from collections.abc import Callable


def pid_alive(pid: int) -> bool:
    """Whether a local process exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def dead_peer(peers: dict[int, int], finished: Callable[[int], bool]) -> str | None:
    """What happened to the first of `peers` (rank -> pid on this host) whose process is gone although it had not
    `finished(rank)`; None when there is none."""
    for r, pid in peers.items():
        if pid_alive(pid) or finished(r):
            continue
        return (f"rank {r} (pid {pid}) died without reporting an error: it was killed (e.g. SIGKILL, out of memory) "
                "or crashed")
    return None
