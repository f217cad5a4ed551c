"""docs/hf_coverage.md stays in step with the code: a sample of its rows recomputed by examples/hf_coverage.py --check
(2 processes: the tiny model of each family built and split over tensor_parallel=2, with and without sequence parallel,
against one process), its counts and transformers version checked against its own table and the installed one."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers",
                                   reason="lightning_bfpp.hf needs the [hf] extra: pip install -e '.[dev,hf]'")

from launch import ROOT, clean_env  # noqa: E402

PAGE = ROOT / "docs" / "hf_coverage.md"
# q/k norms over heads, no pipeline plan with experts kept whole, an
# activation's weights summed over tp, multi-head latent attention, a family refused before TP
SAMPLE = ["qwen3", "olmoe", "apertus", "deepseek_v3", "bert"]


def rows() -> dict[str, list[str]]:
    return {cells[1].strip(" `"): [c.strip() for c in cells[3:6]]
            for cells in (line.split("|") for line in PAGE.read_text().splitlines() if line.startswith("| `"))}


def test_the_page_counts_its_own_rows_for_the_installed_transformers():
    text, table = PAGE.read_text(), rows()
    assert f"installed transformers ({transformers.__version__}," in text, \
        "docs/hf_coverage.md was made with another transformers: run python examples/hf_coverage.py"
    counts = re.search(r"\*\*(\d+) of (\d+) families pass PP, (\d+) TP, (\d+) SP\.\*\*", text).groups()
    assert [int(c) for c in counts] == [sum(r[0] == "✓" for r in table.values()), len(table),
                                        sum(r[1] == "✓" for r in table.values()),
                                        sum(r[2] == "✓" for r in table.values())]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert set(table) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)  # every causal-LM family, once
    assert all(table[f] == ["✓", "✓", "✓"] for f in ("llama", "qwen3", "gemma3_text", "olmo2", "mistral"))


def test_the_pages_rows_are_what_the_code_measures_now():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_coverage.py"), "--check", *SAMPLE],
                            env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
