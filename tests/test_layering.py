"""pdserve's import graph, read from the ast of every module (imports inside functions and
under TYPE_CHECKING count too): no cycle, and no folder importing one above it; what the
processes load: the ingress no torch, the workers' folders no Ray; and no module too long to
hold one responsibility.

Layers, bottom up (docs/design.md): engine, {handoff, planes}, {prefill, decode, ranks},
router, cluster, bench, the command line. `log`, `replica`, `faults` and `auth` are leaves
every layer may use. Inside the engine, its folders have floors of their own (kv and
attention, then parallel and tiers, then models) and take from its root only its records.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import pdserve

PACKAGE = Path(pdserve.__file__).resolve().parent
LAYERS = {"engine": 0, "handoff": 1, "planes": 1, "prefill": 2, "decode": 2, "ranks": 2,
          "router": 3, "cluster": 4, "bench": 5, "cli": 6}
LEAVES = {"log", "replica", "faults", "auth"}
# Folders whose code Serve deploys or runs in a worker, but which import nothing of Ray: the
# app builder hands them what they need of it (ranks, replica context).
RAY_FREE = ("engine", "handoff", "planes", "prefill", "decode")
# The engine's folders, bottom up; its root holds the core (scheduler, runner, engine) and
# the records and leaf helpers every floor shares, the only root modules a folder may import.
ENGINE_FLOORS = {"kv": 0, "attention": 0, "parallel": 1, "tiers": 1, "models": 2}
ENGINE_RECORDS = {"errors", "request", "model_config", "threads", "native_build"}


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


def _engine_folder(module: str) -> str | None:
    """The engine folder a module lives in (or is), None for the engine's root modules."""
    parts = module.split(".")
    if parts[:2] != ["pdserve", "engine"] or len(parts) < 3:
        return None
    return parts[2] if len(parts) > 3 or (PACKAGE / "engine" / parts[2]).is_dir() else None


def test_no_engine_folder_imports_one_above_it_or_the_engine_core() -> None:
    upward = []
    for module, targets in _graph().items():
        source = _engine_folder(module)
        if source is None:
            continue
        for target in targets:
            folder = _engine_folder(target)
            if folder == source or not target.startswith("pdserve.engine."):
                continue
            if folder is None:  # the engine's root: its records only
                if target.removeprefix("pdserve.engine.") not in ENGINE_RECORDS:
                    upward.append(f"{module} -> {target}")
            elif ENGINE_FLOORS[folder] >= ENGINE_FLOORS[source]:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_every_engine_folder_has_a_floor() -> None:
    folders = {_engine_folder(m) for m in _graph()} - {None}
    assert folders == set(ENGINE_FLOORS), folders ^ set(ENGINE_FLOORS)


def _top_level_imports(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module.split(".")[0]


def test_the_workers_folders_import_no_ray() -> None:
    offenders = [module for module, path in _modules().items()
                 if _layer_of(module) in RAY_FREE and "ray" in set(_top_level_imports(path))]
    assert offenders == []


def test_the_ingress_process_loads_no_torch_and_no_model_code() -> None:
    """What importing the ingress loads: errors, records and the tokenizer of the engine
    (torch-free), none of its model, attention or KV code, and no torch (the grammar library,
    which loads torch, comes only with the first request that asks for a grammar)."""
    code = ("import sys, pdserve.router.ingress; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') "
            "or m.startswith('pdserve.engine.') or m.startswith('pdserve.handoff')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=PACKAGE.parent)
    loaded = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert not [m for m in loaded if m.split(".")[0] == "torch"], loaded
    assert not [m for m in loaded if m.startswith("pdserve.handoff")], loaded
    assert set(loaded) <= {f"pdserve.engine.{m}" for m in INGRESS_ENGINE_MODULES}, loaded


# The engine's torch-free modules the ingress uses: errors, sampling parameters, the
# tokenizer (and the control tokens it keeps out of text), hashes and KV events of the prefix
# index, the reuse record and logprobs it reports.
INGRESS_ENGINE_MODULES = ("errors", "sampling_params", "tokenizer", "control_tokens", "kv",
                          "kv.block_hash", "kv.events", "tiers", "tiers.cost", "logprobs",
                          "grammar_spec")


def test_the_design_documents_every_code_folder() -> None:
    """docs/design.md's folder table has a row for every folder of modules in the package."""
    table = (PACKAGE.parent / "docs" / "design.md").read_text().split("## Folders", 1)[1]
    rows = {line.split("|")[1].strip().split()[0].strip("`") for line in table.splitlines()
            if line.startswith("| `")}
    folders = {f"{path.relative_to(PACKAGE).as_posix()}/" for path in PACKAGE.rglob("*")
               if path.is_dir() and any(path.glob("*.py"))}
    assert folders <= rows, folders - rows


def test_every_folder_has_a_layer() -> None:
    folders = {_layer_of(m) for m in _graph()} - {"pdserve"}
    assert folders <= set(LAYERS) | LEAVES, folders - set(LAYERS) - LEAVES


# Past this a module holds more than one thing (docs/design.md, "Folders").
MAX_MODULE_LINES = 400


def test_no_module_is_over_400_lines() -> None:
    root = PACKAGE.parent
    long = {str(path.relative_to(root)): n for folder in ("pdserve", "tests", "benchmarks")
            for path in (root / folder).rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules: {long}"


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_finder_finds_cycles(edges: dict[str, set[str]],
                                       expected: list[list[str]]) -> None:
    assert _cycles(edges) == expected
