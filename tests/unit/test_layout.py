"""The tree keeps its rooms: what the layout promises, checked on the source itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "libs" / "quillcache_core"
RUNTIME = [CORE, *sorted((ROOT / "services").iterdir())]


def sources(*roots: Path) -> list[Path]:
    return [p for root in roots for p in sorted(root.rglob("*.py")) if "_pb2" not in p.name]


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def strings(path: Path) -> str:
    """Every string constant of the code but docstrings, joined."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return "\n".join(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    )


def test_the_runtime_never_imports_the_bench_package():
    offenders = {
        str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if "quillcache_bench" in m)
        for p in sources(*RUNTIME)
    }
    assert {p: m for p, m in offenders.items() if m} == {}
    # Nor by name, through importlib: the bench commands come through an entry point.
    named = [
        str(p.relative_to(ROOT)) for p in sources(*RUNTIME) if "quillcache_bench" in strings(p)
    ]
    assert named == []


def test_no_benchmark_lives_in_a_service():
    assert sorted(ROOT.glob("services/**/bench*.py")) == []


def test_core_has_few_top_level_modules():
    assert len(list(CORE.glob("*.py"))) <= 12


SERVICES = ("quillcache_store", "quillcache_conductor", "quillcache_gateway",
            "quillcache_transfer", "quillcache_simengine")  # fmt: skip


def test_no_library_imports_a_service():
    """Services are built on the libraries, never the reverse: what two services share
    (the store's client half, the event translator) lives in `quillcache_core`. The
    launcher names the services' entry modules as strings, which start processes."""
    bad = {}
    for path in sources(ROOT / "libs"):
        up = sorted(m for m in imported_modules(path) if m.split(".")[0] in SERVICES)
        if up:
            bad[str(path.relative_to(ROOT))] = up
    assert bad == {}


def test_a_service_imports_no_other_service():
    bad = {}
    for room in sorted((ROOT / "services").iterdir()):
        own = f"quillcache_{room.name}"
        for path in sources(room):
            other = sorted(
                m
                for m in imported_modules(path)
                if m.split(".")[0] in SERVICES and m.split(".")[0] != own
            )
            if other:
                bad[str(path.relative_to(ROOT))] = other
    assert bad == {}


def test_core_rooms_do_not_import_the_launcher_or_the_services():
    # launch/ starts processes; every other room is used by them, never the reverse.
    rooms = [p for p in CORE.iterdir() if p.is_dir() and p.name not in ("launch", "__pycache__")]
    bad = {}
    for path in sources(*rooms, *CORE.glob("*.py")):
        up = sorted(
            m
            for m in imported_modules(path)
            if m.startswith("quillcache_core.launch")
            or (m.startswith("quillcache_") and not m.startswith("quillcache_core"))
        )
        if up:
            bad[str(path.relative_to(ROOT))] = up
    assert bad == {}


# Private by Python's convention, public by the library's documentation.
DOCUMENTED_PRIVATE = {"_exit", "_getframe", "_replace", "_asdict", "_fields", "_make"}


def _defined_names(tree: ast.AST) -> set[str]:
    """Every name a file defines or binds: functions, classes, attributes it assigns,
    variables, parameters, imports, `__slots__` entries."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names.update(
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return names


def test_no_private_attribute_is_touched_across_files():
    """`obj._name` outside `self`/`cls`/`super()` only where this file defines `_name`:
    what another module keeps private stays its own (tests may look inside)."""
    found = []
    for path in sources(ROOT / "libs", ROOT / "services"):
        tree = ast.parse(path.read_text(), str(path))
        own = _defined_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in DOCUMENTED_PRIVATE:
                continue
            if name.endswith("_") or name in own:  # an enum's _name_, or this file's own
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "super":
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
