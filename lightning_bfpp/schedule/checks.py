"""Checks of a setting's value that several parts share (pure Python)."""
from __future__ import annotations

from typing import Any


def is_count(value: Any, least: int = 1) -> bool:
    """An integer (not a bool, not a float such as 2.0) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
