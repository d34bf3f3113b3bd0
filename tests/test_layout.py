"""The house stays navigable: no import circle, no long function, no oversized module.

Read from the source with ``ast`` (nothing is imported), so every ``import`` counts, including
the ones inside functions that were once used to dodge a circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder; runtimes/ and converters/ install as edgeinfer.runtimes / .converters
PACKAGES = {
    "edgeinfer": ROOT / "edgeinfer",
    "edgeinfer.runtimes": ROOT / "runtimes",
    "edgeinfer.converters": ROOT / "converters",
}
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):  # rglob does not follow the two symlinks
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _absolute(name: str) -> str:
    for short in ("runtimes", "converters"):
        if name == short or name.startswith(short + "."):
            return "edgeinfer." + name
    return name


def _imported(module: str, path: Path) -> Iterator[str]:
    """Every product module ``module`` imports, at the top or inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [_absolute(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = _absolute(node.module or "")
            targets = [f"{source}.{alias.name}" for alias in node.names] + [source]
        else:
            continue
        for target in targets:
            if target in MODULES:
                yield target
                break


def _graph() -> dict[str, set[str]]:
    return {name: set(_imported(name, path)) - {name} for name, path in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_checker_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_import_walk_sees_imports_inside_functions():
    graph = _graph()
    assert "edgeinfer.errors" in graph["edgeinfer.bounded_json"]
    assert len(MODULES) > 50  # the walk found the whole product


def test_no_import_circle_in_the_product():
    assert _circles(_graph()) == []


def _long_functions() -> Iterator[str]:
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    yield f"{name}.{node.name}: {lines} lines"


def test_no_product_function_is_over_60_lines():
    assert list(_long_functions()) == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_product_module_is_over_500_lines(name: str):
    lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{name} has {lines} lines"


@pytest.mark.parametrize("name", sorted(n for n, p in MODULES.items() if p.name == "__init__.py"))
def test_every_package_says_what_lives_there(name: str):
    docstring = ast.get_docstring(ast.parse(MODULES[name].read_text(encoding="utf-8")))
    assert docstring and len(docstring) > 40, f"{name}/__init__.py needs a docstring"


# The core's top: the public API and what every wing shares; everything else lives in a wing
# (generation/, memory/, machine/, files/, embedding/) or a front (cli/, serve/, batch/, ...).
TOP_MODULES = {
    "__init__", "__main__", "bounded_json", "config", "errors", "load_plan", "loader", "model",
    "model_guards", "progress",
}  # fmt: skip
MAX_ROOM_ARROWS = 120


def _room(module: str) -> str:
    """A room: a module or package directly under ``edgeinfer`` (``runtimes`` and
    ``converters`` one each)."""
    return ".".join(module.split(".")[:2])


def test_no_loose_module_at_the_top_of_the_core():
    loose = {
        path.stem for path in (ROOT / "edgeinfer").glob("*.py") if path.stem not in TOP_MODULES
    }
    assert not loose, f"{sorted(loose)}: put each in the wing whose __init__ describes it"


def test_rooms_are_joined_by_at_most_120_arrows():
    graph = _graph()
    arrows = {(_room(a), _room(b)) for a, bs in graph.items() for b in bs}
    arrows = {(a, b) for a, b in arrows if a != b}
    assert len({_room(m) for m in graph}) >= 20  # the walk saw the wings as rooms
    assert len(arrows) <= MAX_ROOM_ARROWS, sorted(arrows)
