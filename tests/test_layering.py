"""Backends are reached only through their interface: no module reads a private attribute
that another package defines (``model._backend`` from the bench, ``backend._llama`` from
``state/``), and snapshots reach a backend's KV only through ``kv_state()``.

A package here is a folder of the source (``edgeinfer/``, ``edgeinfer/generation/state/``,
``runtimes/``, ...). A private attribute is "defined" by a package when one of its modules
assigns it (``self._x = ...``), or defines a private function, class or module name. A read
``obj._x`` (``obj`` not ``self``, ``cls`` or ``super()``) of a name that the reading package
does not define but another package does is a reach into that package's objects.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("edgeinfer", "runtimes", "converters")


def _defined(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _is_own(value: ast.expr) -> bool:
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def private_reaches(sources: Mapping[str, str]) -> list[str]:
    """``path:line obj._name`` for each read of a private name another package defines;
    ``sources`` maps a path (its folder is its package) to its text."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    by_package: dict[str, set[str]] = defaultdict(set)
    for path, tree in trees.items():
        by_package[str(Path(path).parent)] |= _defined(tree)
    found = []
    for path, tree in trees.items():
        own = by_package[str(Path(path).parent)]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or _is_own(node.value):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in own:
                continue
            if any(name in names for names in by_package.values()):
                found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return found


def _tree() -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
        for folder in SOURCES
        for p in sorted((ROOT / folder).rglob("*.py"))
    }


def test_no_module_reads_another_packages_private_attributes() -> None:
    assert private_reaches(_tree()) == []


def test_the_check_finds_a_reach_into_a_backend() -> None:
    """The check itself: a snapshot module reading the backend's handle, or a bench reading
    the model's backend, is found; the backend's own package reading it is not."""
    sources = _tree()
    sources["edgeinfer/generation/state/peek.py"] = (
        "def peek(backend):\n    return backend._llama\n"
    )
    sources["edgeinfer/bench/peek.py"] = "def peek(model):\n    return model._backend\n"
    sources["runtimes/peek.py"] = "def peek(backend):\n    return backend._llama\n"
    assert sorted(private_reaches(sources)) == [
        "edgeinfer/bench/peek.py:2 model._backend",
        "edgeinfer/generation/state/peek.py:2 backend._llama",
    ]


def test_snapshots_reach_the_kv_only_through_the_backends_kv_state() -> None:
    """``state/`` imports no backend module and picks none by name: the backend hands out
    its ``KVState`` (``runtimes.base``)."""
    for path in sorted((ROOT / "edgeinfer" / "state").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and "runtimes" in (node.module or ""):
                assert (node.module or "").endswith("runtimes.base"), (path.name, node.module)
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [a.name for a in node.names]
                if isinstance(node, ast.ImportFrom):
                    modules.append(node.module or "")
                assert "importlib" not in modules, path.name
