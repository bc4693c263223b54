"""The house's floors, checked over every import in the code (function-local ones included): each import points
down a layer, and no two packages of one floor import each other. ARCHITECTURE.md draws the same picture.

    roof     vlmstream.cli                                   the command and the tools (run, replay, export, ...)
    stages   producers | consumers.decode | consumers.infer | consumers.results | consumers.condense (none imports another)
    ground   vlmstream.* (config, kafka, images, models, broker, profiling)        (no loops between them)
    bottom   schemas
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "vlmstream", "producers", "consumers")


def floor_and_unit(module: str) -> tuple[int, str] | None:
    """(floor, unit) of a project module: a unit is the package that owns one concept on its floor."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if parts[0] == "schemas":
        return 0, "schemas"
    if parts[0] == "vlmstream":
        if len(parts) > 1 and parts[1] == "cli":
            return 3, "vlmstream.cli"
        return 1, ".".join(parts[:2])
    if parts[0] == "producers":
        return 2, "producers"
    if len(parts) > 1:
        return 2, ".".join(parts[:2])  # consumers.decode, consumers.infer, consumers.results
    return 2, "consumers"


def project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[module.removesuffix(".__init__")] = path
    return found


def imports_of(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.append((node.lineno, base))
            # `from vlmstream.cli import run` names a module too: count it as that module's import
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def edges(modules: dict[str, Path] | None = None) -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, where) for every import between two different project units."""
    modules = modules or project_modules()
    found = []
    for module, path in modules.items():
        here = floor_and_unit(module)
        for line, target in imports_of(module, path):
            if target not in modules:
                continue  # a name imported from a module (its module is counted on its own), or not ours
            there = floor_and_unit(target)
            if there and there[1] != here[1]:
                found.append((here[1], there[1], f"{path.name}:{line} ({module}) imports {target}"))
    return found


def floor(unit: str) -> int:
    return floor_and_unit(unit + ".x")[0] if unit != "consumers" else 2


def test_every_import_points_down_a_floor(modules: dict[str, Path] | None = None):
    found = edges(modules)
    upward = [where for src, dst, where in found if floor(dst) > floor(src)]
    sideways = [where for src, dst, where in found if floor(dst) == floor(src) == 2]
    assert not upward, "imports that point up a floor:\n" + "\n".join(upward)
    assert not sideways, "stages that import each other (share it one floor down instead):\n" + "\n".join(sideways)


def test_no_loops_between_packages():
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst, _ in edges():
        graph[src].add(dst)
    loops = []

    def visit(unit: str, path: list[str]) -> None:
        for nxt in graph.get(unit, ()):
            if nxt in path:
                loops.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif len(path) < 12:
                visit(nxt, path + [nxt])

    for unit in list(graph):
        visit(unit, [unit])
    assert not loops, "packages that import each other in a loop:\n" + "\n".join(sorted(set(loops)))


def module_circles(modules: dict[str, Path] | None = None) -> list[list[str]]:
    """Groups of two or more project modules that reach each other through their imports (any import: function-local
    and type-checking ones too), by Tarjan's strongly connected components."""
    modules = modules or project_modules()
    graph = {m: {t for _, t in imports_of(m, p) if t in modules and t != m} for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                circles.append(sorted(group))

    for module in graph:
        if module not in index:
            visit(module)
    return circles


def test_no_import_circles_between_modules(modules: dict[str, Path] | None = None):
    circles = module_circles(modules)
    assert not circles, "modules that import each other, directly or round a circle:\n" + "\n".join(
        " <-> ".join(group) for group in circles)


def test_the_circle_check_catches_a_circle(tmp_path):
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("from consumers.decode import second\n")
    second.write_text("def f():\n    from consumers.decode.first import f\n")
    modules = {**project_modules(), "consumers.decode.first": first, "consumers.decode.second": second}
    with pytest.raises(AssertionError, match="consumers.decode.first <-> consumers.decode.second"):
        test_no_import_circles_between_modules(modules)


@pytest.mark.parametrize("bad_import, expected", [
    ("from vlmstream.cli.run import run", "up a floor"),
    ("from consumers.infer.runner import InferenceRunner", "import each other"),
])
def test_the_check_catches_a_bad_import(tmp_path, bad_import, expected):
    """The check itself can fail: a function-local import of consumers.decode that points up or sideways."""
    planted = tmp_path / "planted.py"
    planted.write_text(f"def f():\n    {bad_import}\n")
    modules = {**project_modules(), "consumers.decode.planted": planted}
    with pytest.raises(AssertionError, match=expected):
        test_every_import_points_down_a_floor(modules)
