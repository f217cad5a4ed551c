"""The dependency versions lightning-bfpp was tested with, checked when a module that uses their private APIs is
imported (lightning_bfpp/_private/pipelining.py, torch_fast_paths.py, torch_api.py and lightning_api.py).
pyproject.toml states the same ranges (tests/test_private_apis.py compares them)."""
from __future__ import annotations

import os
import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

# distribution -> (lowest tested minor release, first untested minor release): [lo, hi)
SUPPORTED: dict[str, tuple[str, str]] = {
    "torch": ("2.13", "2.14"),
    "lightning": ("2.6", "2.7"),
    "torchmetrics": ("1.9", "1.10"),
}
# Set to 1 to import anyway on an untested version (a warning instead of the error): e.g. a cluster image whose torch
# cannot be changed. The private APIs may differ there; tests/test_private_apis.py lists them.
ALLOW_UNTESTED = "LIGHTNING_BFPP_ALLOW_UNTESTED_VERSIONS"


def check_version(distribution: str, installed: str | None = None) -> None:
    """Raise ImportError naming `distribution`'s installed version and the tested range when it lies outside
    it (pre-releases of the first untested minor release included); only warn when `ALLOW_UNTESTED` is 1.
    `installed`: default, the installed one."""
    lo, hi = SUPPORTED[distribution]
    if installed is None:
        try:
            installed = version(distribution)
        except PackageNotFoundError:  # e.g. a source checkout of torch: nothing to compare against
            return
    release = Version(installed).release[:2]
    if not Version(lo).release <= release < Version(hi).release:
        message = (f"lightning-bfpp uses private APIs of {distribution} that were tested on "
                   f"{distribution}>={lo},<{hi}; this is {distribution} {installed}.")
        if os.environ.get(ALLOW_UNTESTED) == "1":
            warnings.warn(f"{message} Imported anyway ({ALLOW_UNTESTED}=1): a private API that changed fails where "
                          "it is used.", stacklevel=2)
            return
        raise ImportError(f"{message} Install e.g. `pip install '{distribution}>={lo},<{hi}'`, or set "
                          f"{ALLOW_UNTESTED}=1 to import anyway at your own risk (docs/development.md: private APIs).")
