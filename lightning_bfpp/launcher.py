# Scope: Lightning's popen launcher as bfpp uses it: the model is checked before any other process starts,
# and the launching process can stop its children (after giving them time to stop by themselves).
from __future__ import annotations

import inspect
import signal
import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override


class CheckingLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher (this process is rank 0 and starts ranks 1..), running `check` first: a model that
    cannot be cut into the requested stages fails once, here, before any other process or process group exists."""

    def __init__(self, check: Callable[[str | None], None], *args: Any) -> None:
        super().__init__(*args)
        self._check = check

    @override
    def launch(self, function, *args: Any, trainer=None, **kwargs: Any) -> Any:
        self._check(ckpt_path_of(function, args, kwargs))
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def stop_children(self, wait: float = 0.0) -> None:
        """SIGKILL the child ranks still running after `wait` seconds (none are left behind)."""
        deadline = time.monotonic() + wait
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.kill(signal.SIGKILL)


def ckpt_path_of(function: Callable, args: tuple, kwargs: dict) -> str | None:
    """The `ckpt_path` argument of a Trainer entry point (`_fit_impl`, `_validate_impl`, ...), if it has one."""
    try:
        return inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):
        return None
