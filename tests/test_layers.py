"""Import rules between the package's layers, read from the modules' own import statements (no imports run):
schedule (pure Python) <- sim (pure Python, + matplotlib for pictures) <- runtime <- strategy."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "lightning_bfpp"
STDLIB = set(sys.stdlib_module_names)

# package -> (may import, besides the standard library) as module-name prefixes
ALLOWED = {
    "lightning_bfpp.schedule": ("lightning_bfpp.schedule",),
    "lightning_bfpp.sim": ("lightning_bfpp.schedule", "lightning_bfpp.sim", "matplotlib"),
}
# package -> what it must not import (anything else is allowed)
FORBIDDEN = {
    "lightning_bfpp.runtime": ("lightning", "lightning_bfpp.strategy", "lightning_bfpp.metrics", "lightning_bfpp.launcher"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, is_package: bool = False) -> list[str]:
    """Absolute names of every module `source` (the code of `module`) imports, anywhere in the file."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if not node.level:
                names.append(node.module)
                continue
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1])
            names += [f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names]
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of `module` that break its layer's rule."""
    layer = next((p for p in (*ALLOWED, *FORBIDDEN) if _under(module, (p,))), None)
    bad = []
    for name in imported(source, module, is_package):
        if layer in ALLOWED and not (name.split(".")[0] in STDLIB or _under(name, ALLOWED[layer])):
            bad.append(name)
        elif layer in FORBIDDEN and _under(name, FORBIDDEN[layer]):
            bad.append(name)
    return bad


MODULES = sorted(p for layer in (*ALLOWED, *FORBIDDEN) for p in (PKG / layer.split(".")[1]).glob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_module_imports_follow_the_layers(path):
    bad = violations(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not bad, f"{module_name(path)} imports {bad}: schedule <- sim <- runtime <- strategy (README: How it works)"


def test_the_check_sees_relative_lazy_and_plain_imports():
    code = "import torch\nfrom ..partition import x\ndef f():\n    from lightning_bfpp.runtime import y\nfrom .cost import c\n"
    assert violations(code, "lightning_bfpp.sim.draw") == ["torch", "lightning_bfpp.partition", "lightning_bfpp.runtime"]
    assert violations("from ..sim import a\nimport json\n", "lightning_bfpp.schedule.lower") == ["lightning_bfpp.sim"]
    assert violations("from . import actions\n", "lightning_bfpp.schedule", is_package=True) == []
    assert violations("from ..strategy import S\nimport torch\n", "lightning_bfpp.runtime.pipeline") == ["lightning_bfpp.strategy"]


def _run(code: str) -> str:
    """`code` in a fresh interpreter (nothing imported yet); its stdout."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PKG.parent)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("package", ["lightning_bfpp", "lightning_bfpp.schedule", "lightning_bfpp.sim",
                                     "lightning_bfpp.calibration"])
def test_pure_packages_import_neither_lightning_nor_torch_distributed(package):
    loaded = _run(f"import sys, {package}\nprint(' '.join(sorted(sys.modules)))").split()
    heavy = [m for m in loaded if _under(m, ("lightning", "pytorch_lightning", "torch.distributed", "lightning_bfpp.strategy"))]
    assert not heavy, f"import {package} loads {heavy[:5]}"


@pytest.mark.parametrize("order", ["lightning_bfpp first", "lightning first"])
def test_import_registers_the_bfpp_strategy(order):
    imports = ["import lightning_bfpp", "from lightning.pytorch import Trainer"]
    code = "\n".join([*(imports if order == "lightning_bfpp first" else imports[::-1]),
                      "from lightning.pytorch.strategies import StrategyRegistry",
                      "assert 'bfpp' in StrategyRegistry",
                      "trainer = Trainer(strategy='bfpp', accelerator='cpu', devices=1, logger=False, enable_checkpointing=False)",
                      "print(type(trainer.strategy).__name__, trainer.strategy is not None)"])
    assert _run(code).split()[-2:] == ["BFPPStrategy", "True"]


def test_without_importing_lightning_bfpp_there_is_no_bfpp_strategy():  # the two tests above see the import's effect
    code = "from lightning.pytorch.strategies import StrategyRegistry\nprint('bfpp' in StrategyRegistry)"
    assert _run(code).split()[-1] == "False"
