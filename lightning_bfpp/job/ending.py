"""How a rank of a stopping job ends: the job's exit codes (``FAILED``, 128 + N after signal N) and the one line
each rank prints to say why."""
from __future__ import annotations

import os
import sys

FAILED = 1  # exit code of every rank when a rank failed (raised, died, lost the store, timed out)


def signal_code(signum: int) -> int:
    """Exit code of every rank when a rank got `signum`: the shell's 128 + N (SIGTERM 143, SIGINT 130)."""
    return 128 + int(signum)


_SAID_STOP: set[tuple[int, str]] = set()  # the lines this process said by say_stop


def say_stop(rank: int, reason: str) -> str:
    """Print why the job stops as one line (see ``say``), once per rank: the main thread's report and the watching
    thread (which sees the same first post when a peer then exits) may both come here with the same reason."""
    text = f"the job stops because {reason}"
    if (rank, text) in _SAID_STOP:
        return f"[rank {rank}] bfpp: {text}"
    _SAID_STOP.add((rank, text))
    return say(rank, text)


def say(rank: int, text: str) -> str:
    """Print `[rank R] bfpp: <text>` as one write of one line, so ranks sharing a terminal or pipe never interleave."""
    message = f"[rank {rank}] bfpp: {text}"
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (message + "\n").encode())  # one write under PIPE_BUF is atomic
    except (AttributeError, OSError, ValueError):  # a stream without a file descriptor (e.g. a notebook's)
        print(message, file=sys.stderr, flush=True)
    return message
