"""Order for parallel runs: the files whose launches take longest run first.

`make test` hands whole files to 2 test processes (`--dist loadfile --no-loadscope-reorder`, in the order below).
In xdist's default order (most tests first) the few-test, many-process files came last, and one test process
sat idle for minutes while the other finished them. A file missing from the list runs after those in it; a wrong
order costs time, never a result."""

from __future__ import annotations

import pytest

LONGEST_FIRST = [  # measured with `make test ARGS=--durations=0` (2 processes, 2 cores), longest first
    "test_exactness.py", "test_user_steps.py", "test_app.py", "test_tensor_parallel.py", "test_checkpoint.py",
    "test_failures.py", "test_signals.py", "test_preemption.py", "test_hf_exact.py", "test_bad_settings.py",
    "test_precision_memory.py", "test_strategy_moves.py", "test_planner.py", "test_hf_app.py", "test_layers.py",
    "test_cli_layouts.py", "test_compile.py", "test_checkpoint_compat.py", "test_device_script.py",
    "test_checkpoint_safety.py", "test_auto_layout.py", "test_mesh.py", "test_watchdog_progress.py",
]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept
