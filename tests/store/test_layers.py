"""The house's arrows run one way: a test fails when a module imports a layer above it.

- ``core/`` (infrastructure) imports no feature package;
- in ``storage/``, ``hashing`` and ``writer`` sit below the interface
  (``base``) and the drivers (``fs``, ``s3``): they never import them;
- in the client, the contract side (``mint``) never imports the worker side
  (``loader``): the safetensors writer both use lives in ``components``.

Imports are read statically (``ast``), lazy ones inside functions included.
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
    assert reaches(CLIENT / "mint.py", ["cgstore_client.loader"]) == []


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from cgstore.storage.base import Storage\n")
    assert reaches(module, ["cgstore.storage.base"]) == ["cgstore.storage.base", "cgstore.storage.base.Storage"]
