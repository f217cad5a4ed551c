"""Order for parallel runs: the files whose launches take longest run first.

`make test` hands whole files to 2 test processes (`--dist loadfile --no-loadscope-reorder`, in the order below).
In xdist's default order (most tests first) the few-test, many-process files came last, and one test process
sat idle for minutes while the other finished them. A file missing from the list runs after those in it; a wrong
order costs time, never a result."""

from __future__ import annotations

import pytest

LONGEST_FIRST = [  # measured with `make test ARGS=--durations=0` (2 processes, 2 cores), longest first
    "test_exactness.py", "test_user_steps.py", "test_app.py", "test_storage_faults.py", "test_docs_snippets.py",
    "test_tensor_parallel.py", "test_checkpoint.py", "test_failures.py", "test_signals.py", "test_preemption.py",
    "test_hf_exact.py",
    "test_bad_settings.py", "test_precision_memory.py", "test_strategy_moves.py", "test_planner.py", "test_hf_app.py",
    "test_layers.py", "test_cli_layouts.py", "test_compile.py", "test_checkpoint_compat.py", "test_device_script.py",
    "test_checkpoint_safety.py", "test_auto_layout.py", "test_mesh.py", "test_watchdog_progress.py",
]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """After a session that ran tests/test_docs_snippets.py: how many of the documentation's code blocks ran, in how
    long, and which are not run, and why."""
    reports = {r.nodeid.rpartition("[")[2].rstrip("]"): r for outcome in ("passed", "failed", "skipped")
               for r in terminalreporter.stats.get(outcome, [])
               if "test_docs_snippets.py::test_block[" in getattr(r, "nodeid", "") and r.when == "call"}
    if not reports:
        return
    from doc_snippets import collect  # tests/ is on sys.path (pyproject's pythonpath)

    blocks, _ = collect()
    ran = [r for r in reports.values() if r.outcome != "skipped"]
    failed = sum(r.outcome == "failed" for r in ran)
    not_run = [b for b in blocks if b.not_run is not None]
    unselected = sum(b.id not in reports and b.not_run is None for b in blocks)
    tr = terminalreporter
    tr.section("documentation code blocks (tests/test_docs_snippets.py)")
    tr.line(f"{len(blocks)} python/bash blocks in README.md, BENCHMARKS.md and docs/*.md: ran {len(ran)} "
            f"({failed} failed) in {sum(r.duration for r in ran):.0f} s; {len(not_run)} not run (below); {unselected} "
            "not selected in this session (the blocks of docs/ are slow tests: make test SLOW=1 runs them)")
    for b in not_run:
        tr.line(f"  not run: {b.id}: {b.not_run}")
