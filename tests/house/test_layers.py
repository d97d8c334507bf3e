"""The house's rules, each a test: a module that breaks one fails here.

- ``core/`` (infrastructure) imports no feature package;
- in ``storage/``, ``hashing`` and ``writer`` sit below the interface
  (``base``) and the drivers (``fs``, ``s3``): they never import them;
- the client's contract (everything in ``cgstore_client`` but ``worker/``
  and the package root, which re-exports the worker's ``Client``) never
  imports the worker side; the store imports only the contract;
- no import circle anywhere in the store or the client;
- no module imports another module's private name (``from x import _y``).

Imports are read statically (``ast``): lazy ones inside functions and those
under ``TYPE_CHECKING`` included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STORE = ROOT / "store" / "cgstore"
CLIENT = ROOT / "client" / "cgstore_client"
FEATURES = sorted(p.name for p in STORE.iterdir() if p.is_dir() and p.name not in {"core", "__pycache__"})


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its body."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def reaches(path: Path, forbidden: list[str]) -> list[str]:
    return sorted(m for m in imported_modules(path) for f in forbidden if m == f or m.startswith(f + "."))


@pytest.mark.parametrize("module", sorted((STORE / "core").glob("*.py")), ids=lambda p: p.name)
def test_core_imports_no_feature(module):
    assert reaches(module, [f"cgstore.{feature}" for feature in FEATURES]) == []


@pytest.mark.parametrize("lower", ["hashing.py", "writer.py"])
def test_storage_verification_sits_below_the_interface_and_the_drivers(lower):
    above = ["cgstore.storage.base", "cgstore.storage.fs", "cgstore.storage.s3"]
    assert reaches(STORE / "storage" / lower, above) == []


def test_the_contract_side_does_not_reach_into_the_worker_side():
    assert reaches(CLIENT / "mint.py", ["cgstore_client.worker.loader"]) == []


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from cgstore.storage.base import Storage\n")
    assert reaches(module, ["cgstore.storage.base"]) == ["cgstore.storage.base", "cgstore.storage.base.Storage"]


# -- circles and private names, over every module of the store and the client --------------

PACKAGES = {"cgstore": STORE, "cgstore_client": CLIENT}


def module_name(path: Path) -> str:
    for top, base in PACKAGES.items():
        if path.is_relative_to(base):
            parts = [top, *path.relative_to(base).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


MODULES = {module_name(p): p for base in PACKAGES.values() for p in sorted(base.rglob("*.py"))}


def _absolute(module: str, node: ast.ImportFrom) -> str | None:
    """The module an ``import from`` names, relative imports resolved against ``module``."""
    if not node.level:
        return node.module
    package = module.split(".")
    if MODULES[module].name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def import_edges(module: str) -> tuple[set[str], list[str]]:
    """The project modules ``module`` imports (any depth, ``TYPE_CHECKING`` included), and the
    private names it takes from another module (``from x import _y``)."""
    edges: set[str] = set()
    private: list[str] = []
    for node in ast.walk(ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom) and (base := _absolute(module, node)) is not None:
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    edges.add(f"{base}.{alias.name}")
                elif base in MODULES:
                    edges.add(base)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{base}.{alias.name}")
    edges.discard(module)
    return edges, private


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


GRAPH = {module: import_edges(module)[0] for module in MODULES}


def test_no_import_circle_in_the_store_or_the_client():
    assert circles(GRAPH) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_another_modules_private_name(module):
    assert import_edges(module)[1] == []


def test_the_circle_check_sees_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


# -- the client's seam: the contract never imports the worker side -------------------------

WORKER = CLIENT / "worker"
CONTRACT = sorted(p for p in CLIENT.rglob("*.py") if not p.is_relative_to(WORKER) and p != CLIENT / "__init__.py")


@pytest.mark.parametrize("module", CONTRACT, ids=lambda p: str(p.relative_to(CLIENT)))
def test_the_contract_never_imports_the_worker_side(module):
    # The package root re-exports the worker's Client: importing it from the contract is the worker too.
    assert reaches(module, ["cgstore_client.worker"]) == []
    assert "cgstore_client" not in imported_modules(module)


def test_the_store_imports_only_the_contract():
    store_modules = sorted(STORE.rglob("*.py"))
    assert [str(p.relative_to(STORE)) for p in store_modules if reaches(p, ["cgstore_client.worker"])] == []
