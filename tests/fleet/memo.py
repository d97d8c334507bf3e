"""The fleet tests' compile memo: one real AOTInductor compile per graph for the whole session, whatever mints it.

Every fleet scenario runs on both configurations (embedded and production), and each scenario's mints are
what it counts: one mint child per declaration granted, two per takeover. What a mint child compiles,
though, is always the same graph (the tiny model, exported the way ``declaration.py`` says: archive A's
graph), and what the compile makes of it does not depend on the store it is published to. So the mint
children of the fleets that use the memo package through :func:`package_compiled_graph` below: a graph
digest already in the memo directory is the archive compiled for it (copied, with its derived constants);
any other graph is compiled for real and kept for the next mint. The tests seed the memo with the
session's archive A (``tests/support/archives.py``, compiled once and cached across runs), so a fleet's
mint costs what a mint child costs besides the compile: starting, importing torch, loading the program,
publishing, beating and releasing the claim. Each mint child still logs its ``compiling claim`` line,
which is what the tests count.

A compile from the memo takes no time, where a real one outlasts the boots of a whole fleet: with
``FLEET_COMPILE_GATE`` naming a file, the memo's answer waits for that file (a test creates it once every
worker of the fleet has booted, so each one meets the mint in flight, as a fleet does a real compile).

The memo is installed in a process by ``tests/fleet/site/sitecustomize.py`` when ``FLEET_COMPILE_MEMO``
names the memo directory and ``tests/fleet/site`` is on ``PYTHONPATH`` (the workers' environment, which
their mint children inherit). A fleet whose graph must fail to compile (``TORCHINDUCTOR_DEBUG_COMPILE``)
runs without it. The compile itself, its policy and its reproducibility are tested in ``tests/mint``.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from filelock import FileLock

#: The environment variable naming the memo directory.
MEMO_ENV = "FLEET_COMPILE_MEMO"
#: The environment variable naming the file a compile from the memo waits for (when set).
GATE_ENV = "FLEET_COMPILE_GATE"
#: How long a compile waits for its gate at most (then it answers anyway).
GATE_BOUND_S = 300
#: The directory to put on ``PYTHONPATH`` for the memo to be installed.
SITE = Path(__file__).resolve().parent / "site"
ARCHIVE, CONSTANTS = "model.pt2", "model.constants.safetensors"


def entry(memo: Path, graph_digest: str) -> Path:
    return memo / graph_digest.replace(":", "-")


def seed(memo: Path, archive: Path) -> str:
    """Put a compiled archive (and its derived constants) in the memo under its graph digest; returns the digest."""
    from cgstore_client.archive import inspect
    from cgstore_client.mint import derived_constants_path

    digest = inspect(archive).graph_digest
    target = entry(memo, digest)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(archive, target / ARCHIVE)
    if os.path.exists(constants := derived_constants_path(archive)):
        shutil.copy(constants, target / CONSTANTS)
    return digest


def install() -> None:
    """Route ``cgstore_client.mint.package_compiled_graph`` through the memo named by ``FLEET_COMPILE_MEMO``."""
    from cgstore_client import mint

    memo = Path(os.environ[MEMO_ENV])
    compile_for_real = mint.package_compiled_graph

    def package_compiled_graph(program, path, **options):
        from cgstore_client.archive import graph_digest_from_program, inspect
        from cgstore_client.worker.cache import hash_file

        target = entry(memo, graph_digest_from_program(program))
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{target}.lock"):
            if not (target / ARCHIVE).is_file():
                result = compile_for_real(program, path, **options)
                seed(memo, Path(result.path))
                return result
        _wait_for_the_gate()
        shutil.copy(target / ARCHIVE, path)
        constants = None
        if (target / CONSTANTS).is_file():
            constants = mint.derived_constants_path(path)
            shutil.copy(target / CONSTANTS, constants)
        digest, size = hash_file(path)
        return mint.MintResult(str(path), digest, size, inspect(path), constants)

    mint.package_compiled_graph = package_compiled_graph


def _wait_for_the_gate() -> None:
    gate = os.environ.get(GATE_ENV)
    deadline = time.monotonic() + GATE_BOUND_S
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
