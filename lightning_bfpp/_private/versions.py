# Scope: the dependency versions lightning-bfpp was tested with, checked when a module that uses their private
# APIs is imported (lightning_bfpp/_private/pipelining.py, lightning_bfpp/_private/torch_api.py, lightning_bfpp/_private/lightning_api.py). pyproject.toml states the same
# ranges (tests/test_private_apis.py compares them).
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

# distribution -> (lowest tested minor release, first untested minor release): [lo, hi)
SUPPORTED: dict[str, tuple[str, str]] = {
    "torch": ("2.13", "2.14"),
    "lightning": ("2.6", "2.7"),
    "torchmetrics": ("1.9", "1.10"),
}


def check_version(distribution: str, installed: str | None = None) -> None:
    """Raise ImportError naming `distribution`'s installed version and the tested range when it lies outside
    it (pre-releases of the first untested minor release included). `installed`: default, the installed one."""
    lo, hi = SUPPORTED[distribution]
    if installed is None:
        try:
            installed = version(distribution)
        except PackageNotFoundError:  # e.g. a source checkout of torch: nothing to compare against
            return
    release = Version(installed).release[:2]
    if not Version(lo).release <= release < Version(hi).release:
        raise ImportError(
            f"lightning-bfpp uses private APIs of {distribution} that were tested on {distribution}>={lo},<{hi}; "
            f"this is {distribution} {installed}. Install e.g. `pip install '{distribution}>={lo},<{hi}'` "
            "(README: Development, private APIs)."
        )
