"""Every ```python and ```bash block of README.md, BENCHMARKS.md and docs/*.md runs, or is marked as not run
with the reason (the marks: tests/doc_snippets.py). The README's blocks run in `make test`; the documentation's
with the slow tests (`make test SLOW=1`, CI). Each block runs in a fresh process, in a directory of its file's own
(copies of examples/ and conf/, so outputs, checkpoints and logs stay there), with examples/ on PYTHONPATH as the
scripts in examples/ have it; training commands get tiny settings from their `run with:` mark. The session's
summary says how many blocks ran and which were not run, and why (tests/conftest.py)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from doc_snippets import ROOT, collect, with_overrides
from procenv import clean_env

BLOCKS, ERRORS = collect()
TIMEOUT = 600


def _param(block):
    marks = [pytest.mark.slow] if block.file != "README.md" and block.not_run is None else []
    return pytest.param(block, id=block.id, marks=marks)


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """One directory per documentation file, made on its first block: its blocks run there in order."""
    made: dict[str, Path] = {}

    def workdir(file: str) -> Path:
        if file not in made:
            d = tmp_path_factory.mktemp(re.sub(r"\W", "_", file))
            for part in ("examples", "conf"):
                shutil.copytree(ROOT / part, d / part, ignore=shutil.ignore_patterns("__pycache__", "outputs"))
            made[file] = d
        return made[file]

    return workdir


def block_env(cwd: Path) -> dict[str, str]:
    return clean_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(cwd / "examples")]),  # the package, the page's examples
                     PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))  # torchrun


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_block(block, workdirs):
    if block.not_run is not None:
        pytest.skip(f"{block.id}: not run: {block.not_run}")
    cwd = workdirs(block.file)
    name = f"block_{block.line}"
    if block.doctest:
        (cwd / f"{name}.txt").write_text(block.code)
        cmd = [sys.executable, "-c", "import doctest, sys; r = doctest.testfile(sys.argv[1], module_relative=False, "
               "optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE); sys.exit(1 if r.failed else 0)",
               f"{name}.txt"]
    elif block.lang == "python":
        (cwd / f"{name}.py").write_text(block.code)  # a file, not -c: Lightning's launcher re-runs the script
        cmd = [sys.executable, f"{name}.py"]
    else:
        script = with_overrides(block.code, block.run_with) if block.run_with else block.code
        (cwd / f"{name}.sh").write_text(script)
        cmd = ["bash", "-eo", "pipefail", f"{name}.sh"]
    proc = subprocess.run(cmd, cwd=cwd, env=block_env(cwd), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, (f"{block.id} ({block.lang}) failed with exit code {proc.returncode}; ran in {cwd}:\n"
                                  f"{(cwd / cmd[-1]).read_text()}\n--- stdout\n{proc.stdout[-4000:]}\n"
                                  f"--- stderr\n{proc.stderr[-6000:]}")


def test_marks_are_well_formed():
    assert not ERRORS, "\n".join(ERRORS)


def test_blocks_are_found():
    files = {b.file for b in BLOCKS}
    assert {"README.md", "BENCHMARKS.md", "docs/training.md", "docs/checkpoints.md"} <= files
    assert sum(b.not_run is None for b in BLOCKS) > sum(b.not_run is not None for b in BLOCKS)  # most blocks run


def test_readme_is_short_and_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "the README is the landing page: move details to docs/"
    first = next(b for b in BLOCKS if b.file == "README.md")
    assert [line.split("#")[0].strip() for line in first.code.strip().splitlines()] == ["make train", "make test"]


def test_readme_quickstart_runs_as_written_under_strategy_auto(workdirs):
    """The quickstart says its training_step is used as written without bfpp: the same script with strategy="auto"
    (Lightning's own choice for 2 CPU devices, DDP) trains and prints its train_loss."""
    (block,) = [b for b in BLOCKS if b.file == "README.md" and "class MLP(PipelineHooks" in b.code]
    assert "strategy=strategy" in block.code
    cwd = workdirs("README.md (strategy=auto)")
    (cwd / "quickstart_auto.py").write_text(block.code.replace("strategy=strategy", 'strategy="auto"'))
    proc = subprocess.run([sys.executable, "quickstart_auto.py"], cwd=cwd, env=block_env(cwd), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert re.search(r"rank 0: train_loss \d", proc.stdout), proc.stdout[-2000:]


def test_the_readme_quickstart_is_examples_minimal_py():
    """examples/minimal.py is the quickstart as a file: its code after the docstring is the README's block, so the
    block's run in `make test` (test_doc_block) runs the file's code too."""
    (block,) = [b for b in BLOCKS if b.file == "README.md" and "class MLP(PipelineHooks" in b.code]
    source = (ROOT / "examples" / "minimal.py").read_text()
    assert source.split('"""\n\n', 1)[1] == block.code, "README.md's quickstart and examples/minimal.py differ"


def test_readme_links_point_to_files():
    readme = (ROOT / "README.md").read_text()
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme)
               if "://" not in t and not t.startswith("#")}
    missing = sorted(t for t in targets if not (ROOT / t).exists())
    assert not missing, missing


def test_run_with_replaces_keys_and_appends_others():
    script = textwrap.dedent("""\
        # a comment
        python examples/train.py cluster=cpu_2 trainer.max_steps=100 \\
            +trainer.max_epochs=1   # trains
        python -m lightning_bfpp.checkpoint a b
    """)
    out = with_overrides(script, ("trainer.max_steps=2", "data.max_bytes=100000", "trainer.max_epochs=3"))
    assert out.splitlines() == [
        "# a comment",
        "python examples/train.py cluster=cpu_2 trainer.max_steps=2 +trainer.max_epochs=3 data.max_bytes=100000"
        "  # trains",
        "python -m lightning_bfpp.checkpoint a b",
    ]
