"""BFPPStrategy's settings are described in three places that must name the same settings: its docstring (Args,
which ``help()`` and docs/api.md show), the table of docs/settings.md, and, for the app's schedule group, the keys of
conf/schedule/base.yaml (each with its comment). A setting added, renamed or removed in one place fails here until
the others follow. No processes."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import yaml

from lightning_bfpp import BFPPStrategy

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = set(inspect.signature(BFPPStrategy).parameters)


def documented_args(doc: str) -> set[str]:
    """The names in the docstring's ``Args:`` section (one per line at its indentation, then ``name:``)."""
    args = doc.split("Args:", 1)[1]
    indent = re.match(r"\n*( +)", args).group(1)
    return set(re.findall(rf"^{indent}(\w+):", args, flags=re.MULTILINE))


def test_every_setting_is_keyword_only():
    kinds = {p.kind for p in inspect.signature(BFPPStrategy).parameters.values()}
    assert kinds == {inspect.Parameter.KEYWORD_ONLY}, kinds


def test_the_docstring_describes_every_setting_once():
    assert documented_args(BFPPStrategy.__doc__) == SETTINGS


def test_docs_settings_table_lists_every_setting():
    table = (ROOT / "docs" / "settings.md").read_text().split("| argument | default | meaning |", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \|", table.split("\n\n", 1)[0], flags=re.MULTILINE)
    assert len(rows) == len(set(rows)), "a setting has two rows"
    assert set(rows) == SETTINGS, {"missing": sorted(SETTINGS - set(rows)), "unknown": sorted(set(rows) - SETTINGS)}


def test_the_app_schedule_keys_are_settings_each_with_its_comment():
    path = ROOT / "conf" / "schedule" / "base.yaml"
    keys = set(yaml.safe_load(path.read_text())) - {"name"}
    assert keys <= SETTINGS, sorted(keys - SETTINGS)
    uncommented = [line for line in path.read_text().splitlines()
                   if re.match(r"^\w+:", line) and "#" not in line]
    assert not uncommented, uncommented
