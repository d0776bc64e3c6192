"""The package's shape, as docs/development.md states it: imports point one way (no module
reaches, even for a type hint or inside a function, a module that reaches back to it), each
module stays small enough to read, and engine knowledge lives in ``gateway/engines/`` alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "gateway"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every gateway module ``path`` imports, wherever the import stands (TYPE_CHECKING
    blocks and function bodies included): ``from a import b`` is ``a.b`` when that is a
    module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # A package's __init__ that only gathers its modules is not a way back: importing
    # ``gateway.x.y`` runs ``gateway.x`` first anyway, so parent packages are left out.
    return {name: {m for m in _imports(path, name, modules) if not name.startswith(m + ".")}
            for name, path in modules.items()}


def test_no_import_circle_in_the_package() -> None:
    assert _cycles(_graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_type_checking_and_local_imports_count(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from gateway.metrics import GatewayMetrics\n"
                      "def f():\n    import gateway.tokens\n")
    assert _imports(source, "gateway.m", _modules()) == {"gateway.metrics", "gateway.tokens"}


def test_no_module_over_600_lines() -> None:
    long = {_module_name(p): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_engine_names_are_asked_only_in_the_engine_modules() -> None:
    """Nothing outside ``gateway/engines/`` branches on an engine's name: it asks the
    engine (``gateway.engines.get``)."""
    pattern = re.compile(r"engine\s*(==|!=)|engine in [({\[\"]")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in PACKAGE.rglob("*.py")
             if "engines" not in p.relative_to(PACKAGE).parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
