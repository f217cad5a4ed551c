"""Import rules between the package's parts, read from the modules' own import statements (no imports run).

The parts, each a folder of ``lightning_bfpp/`` whose ``__init__`` says what it may import (or, for ``dims``, a
module whose docstring says it); each may import only the parts listed before it: schedule (pure Python) <- dims (pure
Python: the layout's one owner) <- sim (pure Python) <- contract <- _private <- layout <- runtime <- adapter;
checkpoint and job over _private; hf over contract, layout and checkpoint; data over contract and job; the strategy
and the package face over everything. ``schedule/dims.py`` is the old path of ``dims``: a re-export, nothing more.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "lightning_bfpp"
STDLIB = set(sys.stdlib_module_names)
P = "lightning_bfpp."

# part -> the parts of the package it may import (besides itself)
PARTS = {
    "schedule": (),
    "dims": ("schedule",),
    "sim": ("schedule", "dims"),
    "contract": (),
    "_private": ("schedule", "dims", "contract"),
    "layout": ("schedule", "dims", "sim", "contract", "_private"),
    "runtime": ("schedule", "dims", "contract", "layout", "_private"),
    "adapter": ("schedule", "dims", "sim", "contract", "layout", "runtime", "_private"),
    "checkpoint": ("_private",),
    "job": ("_private", "checkpoint"),
    "hf": ("contract", "layout", "checkpoint"),
    "data": ("contract", "job"),
}
# pure parts: besides the standard library and the parts above, only these third-party packages
PURE = {"schedule": (), "dims": (), "sim": ("matplotlib", "yaml")}
# part -> third-party packages it must not import
FORBIDDEN = {"runtime": ("lightning",)}
# the modules at the package's top (the face and the strategy); anything else belongs in a part's folder
# modeling.py: the model contract's public names; settings.py: the strategy's settings described (nothing imports it)
TOP = {"__init__.py", "strategy.py", "modeling.py", "settings.py"}
# parts that are one module at the package's top, not a folder (dims.py: the parallel layout, as torchtitan's
# distributed/parallel_dims.py)
MODULE_PARTS = {"dims"}
# old module paths kept importable: old -> the one module it re-exports (it may import that module and nothing else)
REEXPORTS = {"lightning_bfpp.schedule.dims": "lightning_bfpp.dims"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, is_package: bool = False, modules: frozenset[str] = frozenset()) -> list[str]:
    """Absolute names of every module `source` (the code of `module`) imports, anywhere in the file. ``from X import
    name`` where X.name is one of `modules` (a submodule) names X.name alone."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            subs = [f"{base}.{a.name}" for a in node.names]
            if node.module is None and node.level:  # from . import x: x is a module
                names += subs
            elif all(s in modules for s in subs):
                names += subs
            else:
                names.append(base)
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def part_of(module: str) -> str | None:
    """The part (folder) `module` belongs to; None for the modules at the top."""
    rest = module.removeprefix(P).split(".")
    return rest[0] if module.startswith(P) and len(rest) > 1 or rest[0] in PARTS else None


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of `module` that break its part's rule."""
    part = part_of(module)
    if part is None:
        return []
    allowed = (P + part, *(P + p for p in PARTS[part]))
    bad = []
    for name in imported(source, module, is_package):
        if REEXPORTS.get(module) == name:
            continue
        top = name.split(".")[0]
        if name.startswith(P) or name == "lightning_bfpp":
            if not _under(name, allowed):
                bad.append(name)
        elif part in PURE and not (top in STDLIB or top in PURE[part]):
            bad.append(name)
        elif _under(name, FORBIDDEN.get(part, ())):
            bad.append(name)
    return bad


MODULES = sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_module_imports_follow_the_parts(path):
    bad = violations(path.read_text(), module_name(path), path.name == "__init__.py")
    part = part_of(module_name(path))
    assert not bad, f"{module_name(path)} imports {bad}; {part}/ may import {PARTS.get(part)} (its __init__ says why)"


def test_the_check_sees_relative_lazy_and_plain_imports():
    code = ("import torch\nfrom ..layout import x\ndef f():\n    from lightning_bfpp.runtime import y\n"
            "from .cost import c\n")
    assert violations(code, "lightning_bfpp.sim.draw") == ["torch", "lightning_bfpp.layout", "lightning_bfpp.runtime"]
    assert violations("from ..sim import a\nimport json\n", "lightning_bfpp.schedule.lower") == ["lightning_bfpp.sim"]
    assert violations("from . import actions\n", "lightning_bfpp.schedule", is_package=True) == []
    assert violations("from ..strategy import S\nimport lightning\n", "lightning_bfpp.runtime.pipeline") == [
        "lightning_bfpp.strategy", "lightning"]
    assert violations("from ..adapter.steps import s\n", "lightning_bfpp.layout.stages") == [
        "lightning_bfpp.adapter.steps"]
    assert violations("from ..adapter import steps\n", "lightning_bfpp.strategy") == []
    # the layout's owner sits over the schedule only; only the schedule's old path may import it back
    assert violations("from ..dims import ParallelDims\n", "lightning_bfpp.schedule.lower") == ["lightning_bfpp.dims"]
    assert violations("from lightning_bfpp.dims import PP\n", "lightning_bfpp.schedule.dims") == []
    assert violations("from .sim import cost\nimport torch\n", "lightning_bfpp.dims") == [
        "lightning_bfpp.sim", "torch"]
    assert violations("from .schedule.actions import ScheduleSpec\n", "lightning_bfpp.dims") == []


def test_every_part_says_what_it_is_and_what_it_may_import():
    for part in PARTS:
        file = f"{part}.py" if part in MODULE_PARTS else f"{part}/__init__.py"
        doc = ast.get_docstring(ast.parse((PKG / file).read_text())) or ""
        assert "May import" in doc, f"lightning_bfpp/{file}: say what the part is and what it may import"
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    expected = set(PARTS) - MODULE_PARTS
    assert folders == expected, f"folders {folders ^ expected}: add the folder's rule to PARTS"
    modules = TOP | {f"{m}.py" for m in MODULE_PARTS}
    assert {p.name for p in PKG.glob("*.py")} == modules, "a module at the package's top: does it belong in a part?"


@pytest.mark.parametrize("old", sorted(REEXPORTS))
def test_an_old_module_path_only_re_exports_the_new_module(old):
    """The old path holds a docstring, imports of the new module's names, and ``__all__``: no code of its own."""
    new = REEXPORTS[old]
    path = PKG.parent.joinpath(*old.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree) or ""
    assert "old path" in doc and new in doc, f"{old}: say that it is the old path of {new}"
    for node in tree.body[1:]:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        if isinstance(node, ast.ImportFrom):
            assert node.module == new and not node.level, f"{old} imports {ast.unparse(node)}, not only {new}"
        else:
            targets = node.targets if isinstance(node, ast.Assign) else []
            assert [getattr(t, "id", None) for t in targets] == ["__all__"], f"{old}: code besides the re-export"
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    names = set(old_module.__all__)
    assert {n for n in vars(old_module) if not n.startswith("_") and n != "annotations"} == names
    assert all(getattr(old_module, n) is getattr(new_module, n) for n in names)


def test_the_old_dims_path_gives_the_same_objects():
    import lightning_bfpp
    import lightning_bfpp.dims
    import lightning_bfpp.schedule.dims

    assert lightning_bfpp.schedule.dims.ParallelDims is lightning_bfpp.dims.ParallelDims
    assert lightning_bfpp.schedule.dims.LayoutError is lightning_bfpp.dims.LayoutError
    assert lightning_bfpp.ParallelDims is lightning_bfpp.dims.ParallelDims
    assert lightning_bfpp.LayoutError is lightning_bfpp.dims.LayoutError


def _graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in MODULES}
    names = frozenset(modules)
    graph = {}
    for name, path in modules.items():
        deps = imported(path.read_text(), name, path.name == "__init__.py", names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of `graph` (module -> modules it imports), as a path, else None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_loops_between_files():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def _run(code: str) -> str:
    """`code` in a fresh interpreter (nothing imported yet); its stdout."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PKG.parent)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("package", ["lightning_bfpp", "lightning_bfpp.schedule", "lightning_bfpp.dims",
                                     "lightning_bfpp.schedule.dims", "lightning_bfpp.sim",
                                     "lightning_bfpp.sim.calibration", "lightning_bfpp.contract"])
def test_pure_packages_import_neither_lightning_nor_torch_distributed(package):
    loaded = _run(f"import sys, {package}\nprint(' '.join(sorted(sys.modules)))").split()
    heavy = [m for m in loaded
             if _under(m, ("lightning", "pytorch_lightning", "torch.distributed", "lightning_bfpp.strategy"))]
    assert not heavy, f"import {package} loads {heavy[:5]}"


def test_the_schedule_and_the_layout_load_no_torch():
    loaded = _run("import sys, lightning_bfpp.schedule, lightning_bfpp.dims, lightning_bfpp.schedule.dims\n"
                  "print(' '.join(sorted(sys.modules)))").split()
    assert not [m for m in loaded if _under(m, ("torch", "lightning"))], "the schedule and dims.py are pure Python"


@pytest.mark.parametrize("order", ["lightning_bfpp first", "lightning first"])
def test_import_registers_the_bfpp_strategy(order):
    imports = ["import lightning_bfpp", "from lightning.pytorch import Trainer"]
    code = "\n".join([*(imports if order == "lightning_bfpp first" else imports[::-1]),
                      "from lightning.pytorch.strategies import StrategyRegistry",
                      "assert 'bfpp' in StrategyRegistry",
                      "trainer = Trainer(strategy='bfpp', accelerator='cpu', devices=1, logger=False, "
                      "enable_checkpointing=False)",
                      "print(type(trainer.strategy).__name__, trainer.strategy is not None)"])
    assert _run(code).split()[-2:] == ["BFPPStrategy", "True"]


def test_without_importing_lightning_bfpp_there_is_no_bfpp_strategy():  # the two tests above see the import's effect
    code = "from lightning.pytorch.strategies import StrategyRegistry\nprint('bfpp' in StrategyRegistry)"
    assert _run(code).split()[-1] == "False"


# The one owner of the mesh (dims.py: sizes, names, rank <-> coordinates) and the one builder of it (layout/mesh.py):
# nothing else computes where a rank sits in the mesh, builds a mesh, or names a mesh dimension (schedule/dims.py, the
# old path, is a re-export: the rules hold for it as for any other module).
MESH_OWNER, MESH_BUILDER = "lightning_bfpp.dims", "lightning_bfpp.layout.mesh"
MESH_SIZES = {"data_parallel", "tensor_parallel", "context_parallel", "dp", "tp", "cp",  # (pipeline: the schedule's)
              "expert_parallel", "expert_data_parallel", "ep"}
MESH_CONSTRUCTORS = {"init_device_mesh", "DeviceMesh", "from_group", "_unflatten", "_flatten"}
MESH_DIMENSIONS = ("pipeline_parallel", "data_parallel", "tensor_parallel", "context_parallel", "data_context_parallel",
                   "expert_parallel", "expert_data_parallel")


def _identifiers(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _rank_arithmetic(node: ast.BinOp) -> bool:
    """p * dp + d (a rank from coordinates), or any arithmetic of a rank with the data- or tensor-parallel size
    (rank // tp % dp: a coordinate). (A size's divisibility, heads % tp, is not a coordinate.)"""
    if isinstance(node.op, ast.Add) and any(isinstance(side, ast.BinOp) and isinstance(side.op, ast.Mult)
                                            and _identifiers(side) & MESH_SIZES for side in (node.left, node.right)):
        return True
    names = _identifiers(node)
    return any("rank" in n for n in names) and bool(names & MESH_SIZES)


def mesh_rules_broken(source: str, module: str) -> list[str]:
    """What `source` (the code of `module`) does that only the mesh's owner or builder may do."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and module != MESH_OWNER and _rank_arithmetic(node):
            found.append(f"line {node.lineno}: rank arithmetic ({ast.unparse(node)})")
        elif isinstance(node, ast.Call) and module != MESH_BUILDER:
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in MESH_CONSTRUCTORS:
                found.append(f"line {node.lineno}: builds a mesh ({func})")
        elif isinstance(node, ast.Subscript) and module != MESH_OWNER:
            key = node.slice
            if isinstance(key, ast.Constant) and key.value in MESH_DIMENSIONS:
                found.append(f"line {node.lineno}: names a mesh dimension ({ast.unparse(node)}; use dims.py's "
                             "names)")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_only_the_mesh_owner_computes_mesh_coordinates(path):
    broken = mesh_rules_broken(path.read_text(), module_name(path))
    assert not broken, f"{module_name(path)}: {broken}; ask {MESH_OWNER}.ParallelDims (rank, coordinates, ...) instead"


def test_the_mesh_rule_sees_rank_arithmetic_meshes_and_dimension_names():
    code = ("first = (rank // tp) % dp * tp\nranks = [r * data_parallel + d for r in pipeline_ranks]\n"
            "m = init_device_mesh('cpu', (2, 2))\ng = mesh['data_parallel']\nok = mesh[DP]\nn = stage % pp\n"
            "part = rank % ep\ne = mesh['expert_parallel']\nf = mesh[DP]._unflatten(0, (2, 2), ('a', 'b'))\n"
            "c = rank // tp % cp\nh = mesh['context_parallel']\n")
    broken = [b.split(":")[0] for b in mesh_rules_broken(code, "lightning_bfpp.layout.tied")]
    assert sorted(set(broken)) == ["line 1", "line 10", "line 11", "line 2", "line 3", "line 4", "line 7", "line 8",
                                   "line 9"], broken  # not line 5 (a name, not a string) or 6 (stages)
    assert mesh_rules_broken(code, MESH_OWNER) == ["line 3: builds a mesh (init_device_mesh)",
                                                   "line 9: builds a mesh (_unflatten)"]
