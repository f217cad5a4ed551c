"""BFPPStrategy's settings are described once, in ``lightning_bfpp.settings``; three texts are made from it: its
docstring (Args, which ``help()`` and docs/api.md show), the table of docs/settings.md, and, for the app's schedule
group, the comments of conf/schedule/base.yaml. Each must be what the table makes (``python -m lightning_bfpp.settings
--write`` rewrites them) and name the signature's settings: one added, renamed or removed in one place fails here
until the others follow. Their defaults agree too: the signature's, or for a layout setting left at None the one
``UNGIVEN_DEFAULTS`` gives it, is what the docs' table says and what base.yaml sets (except the app's own defaults,
each saying so in its comment). No processes."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_bfpp import BFPPStrategy, settings

ROOT = Path(__file__).resolve().parents[1]
PARAMETERS = inspect.signature(BFPPStrategy).parameters
SETTINGS = set(PARAMETERS)
APP_DEFAULTS = {"pipeline_parallel", "micro_batches"}  # base.yaml's own choices for `make train`'s two processes
NOT_LITERAL = object()
# what each setting is when not given (the signature's default, or the layout's for a layout setting left at None)
EFFECTIVE_DEFAULTS = settings.effective_defaults()


def table_rows() -> dict[str, str]:
    """docs/settings.md's settings tables (one per group, between the markers): argument -> its default cell."""
    tables = settings.TABLES.search((ROOT / "docs" / "settings.md").read_text()).group(0)
    rows = re.findall(r"^\| `(\w+)` \| ([^|]*) \|", tables, flags=re.MULTILINE)
    assert len(rows) == len({name for name, _ in rows}), "a setting has two rows"
    return {name: cell.strip() for name, cell in rows}


def cell_value(cell: str) -> Any:
    """A default cell as a value: a Python literal (`False`, `"stop"`, 5), minutes (`30 min`), else NOT_LITERAL (a
    described default such as "world size" or "see meaning")."""
    if minutes := re.fullmatch(r"(\d+) min", cell):
        return timedelta(minutes=int(minutes.group(1)))
    try:
        return ast.literal_eval(cell.strip("`"))
    except (ValueError, SyntaxError):
        return NOT_LITERAL


def documented_args(doc: str) -> set[str]:
    """The names in the docstring's ``Args:`` section (one per line at its indentation, then ``name:``)."""
    args = doc.split("Args:", 1)[1]
    indent = re.match(r"\n*( +)", args).group(1)
    return set(re.findall(rf"^{indent}(\w+):", args, flags=re.MULTILINE))


def test_every_setting_is_keyword_only():
    kinds = {p.kind for p in inspect.signature(BFPPStrategy).parameters.values()}
    assert kinds == {inspect.Parameter.KEYWORD_ONLY}, kinds


def test_the_settings_table_holds_each_setting_of_the_signature_once_in_its_order():
    assert [s.name for s in settings.SETTINGS] == list(PARAMETERS)


@pytest.mark.parametrize("relative", ["lightning_bfpp/strategy.py", "docs/settings.md", "conf/schedule/base.yaml"])
def test_each_description_is_what_the_settings_table_makes(relative):
    """The docstring's Args, the docs' table and base.yaml's comments are the table's texts, word for word."""
    path = ROOT / relative
    made = settings.rendered(ROOT)[path]
    assert path.read_text() == made, (f"{relative} is not what lightning_bfpp/settings.py makes: describe a setting "
                                      "there, then run `python -m lightning_bfpp.settings --write`")


def test_a_summary_changed_in_the_table_alone_fails_each_of_the_three(monkeypatch):
    """The check above can fail: a summary changed in lightning_bfpp/settings.py without --write differs in all three
    texts (the docstring, the docs' table, base.yaml's comment of `loops`)."""
    changed = tuple(dataclasses.replace(s, summary="stages on each pipeline rank.") if s.name == "loops" else s
                    for s in settings.SETTINGS)
    monkeypatch.setattr(settings, "SETTINGS", changed)
    monkeypatch.setattr(settings, "BY_NAME", {s.name: s for s in changed})
    stale = [p.relative_to(ROOT).as_posix() for p, text in settings.rendered(ROOT).items() if p.read_text() != text]
    assert sorted(stale) == ["conf/schedule/base.yaml", "docs/settings.md", "lightning_bfpp/strategy.py"], stale


def test_the_listing_names_every_setting_with_its_default_under_its_group(capsys):
    settings.main([])
    out = capsys.readouterr().out
    named = re.findall(r"^  (\w+) = (.+)$", out, flags=re.MULTILINE)
    assert [name for name, _ in named] == list(PARAMETERS)
    assert ("loops", "1") in named and ("timeout", "30 min") in named and ("schedule", '"breadth_first"') in named
    titles = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert titles == list(settings.GROUP_TITLES.values())


def test_the_docs_group_the_settings_as_the_signature_does():
    """docs/settings.md has one table per group, in the signature's order, each under its title."""
    tables = settings.TABLES.search((ROOT / "docs" / "settings.md").read_text()).group(0)
    titles = re.findall(r"^\*\*(.+)\*\*$", tables, flags=re.MULTILINE)
    assert titles == [settings.GROUP_TITLES[g] for g in settings.GROUPS]
    assert list(table_rows()) == list(PARAMETERS)


def test_the_docstring_describes_every_setting_once():
    assert documented_args(BFPPStrategy.__doc__) == SETTINGS


def test_docs_settings_table_lists_every_setting():
    rows = set(table_rows())
    assert rows == SETTINGS, {"missing": sorted(SETTINGS - rows), "unknown": sorted(rows - SETTINGS)}


def test_docs_settings_table_gives_each_default():
    """A literal default cell is the setting's default; a described one ("world size", "see meaning") stands for a
    default that depends on the run (None in the signature) or is no literal (a timeout's timedelta)."""
    wrong = {}
    for name, cell in table_rows().items():
        value, default = cell_value(cell), EFFECTIVE_DEFAULTS[name]
        if value is NOT_LITERAL:
            if default is not None and isinstance(default, (bool, int, float, str)):
                wrong[name] = (cell, default)
        elif value != default or type(value) is not type(default):
            wrong[name] = (cell, default)
    assert not wrong, wrong


def test_the_app_schedule_values_are_the_defaults_or_say_they_are_the_apps():
    path = ROOT / "conf" / "schedule" / "base.yaml"
    values = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "name"}
    comments = {line.split(":", 1)[0]: line.split("#", 1)[1] for line in path.read_text().splitlines()
                if re.match(r"^\w+:", line) and "#" in line}
    wrong = {}
    for key, value in values.items():
        default = EFFECTIVE_DEFAULTS[key]
        if isinstance(default, timedelta):
            default = default.total_seconds()
        if key in APP_DEFAULTS:
            if "app default" not in comments[key]:
                wrong[key] = "an app default whose comment does not say so"
        elif value is not None and value != default:  # null: not given, the strategy's default
            wrong[key] = (value, default)
    assert not wrong, wrong


def test_the_app_schedule_keys_are_settings_each_with_its_comment():
    path = ROOT / "conf" / "schedule" / "base.yaml"
    keys = set(yaml.safe_load(path.read_text())) - {"name"}
    assert keys <= SETTINGS, sorted(keys - SETTINGS)
    uncommented = [line for line in path.read_text().splitlines()
                   if re.match(r"^\w+:", line) and "#" not in line]
    assert not uncommented, uncommented
