"""pdserve's import graph, read from the ast of every module (imports inside functions and
under TYPE_CHECKING count too): no cycle, and no folder importing one above it.

Layers, bottom up (docs/design.md): engine, handoff, {prefill, decode, ranks}, router, cluster,
bench, the command line. `log`, `replica` and `faults` are leaves every layer may use.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import pdserve

PACKAGE = Path(pdserve.__file__).resolve().parent
LAYERS = {"engine": 0, "handoff": 1, "prefill": 2, "decode": 2, "ranks": 2, "router": 3,
          "cluster": 4, "bench": 5, "cli": 6}
LEAVES = {"log", "replica", "faults"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("pdserve", *path.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imported(module: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The pdserve modules ``module`` imports (a name imported from a module counts as the
    module when it is not one itself)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                yield name


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: set(_imported(m, p, modules)) for m, p in modules.items()}


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "pdserve"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
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
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_no_folder_imports_one_above_it() -> None:
    upward = []
    for module, targets in _graph().items():
        source = _layer_of(module)
        for target in targets:
            layer = _layer_of(target)
            if layer == source or target == "pdserve":
                continue
            if source in LEAVES or not (layer in LEAVES or LAYERS[layer] < LAYERS[source]):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_every_folder_has_a_layer() -> None:
    folders = {_layer_of(m) for m in _graph()} - {"pdserve"}
    assert folders <= set(LAYERS) | LEAVES, folders - set(LAYERS) - LEAVES


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_finder_finds_cycles(edges: dict[str, set[str]],
                                       expected: list[list[str]]) -> None:
    assert _cycles(edges) == expected
