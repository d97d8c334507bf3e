"""Real ``.pt2`` archives for the test session: compiled once, cached across runs.

An AOTInductor compile costs ~20-40 s on this machine, so the session
compiles exactly five archives, and only when the cache is cold:

``tiny.pt2``
    archive A: :class:`TinyModel` (seed 0) minted in this process.
``tiny-reweighted.pt2``
    the same program with other weights (seed 1), under another file name.
``tied.pt2``
    :class:`TiedLM`: GPT-2's shape in miniature (an embedding tied to the LM
    head, a non-persistent ``position_ids`` buffer as in HF BERT, a dead pooler).
``second-mint.pt2``
    archive A minted again in a *subprocess* with its own
    ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``, ``TMPDIR`` and working
    directory: the double-mint reproducibility witness.
``tiny-sigmoid.pt2``
    :class:`TinyModel` with a sigmoid for the ReLU: archive A's tensors (the
    same binding signature), another graph — what a config flag the
    declaration does not name makes.

The cache lives in ``<repo>/.test-cache/archives/<key>/`` where ``key``
hashes the torch version and the sources that decide the bytes (this file,
the mint, program serialization, device facts, the metadata and key
modules). A warm session compiles nothing. Other test modules (the store's publish tests) use the
fixtures ``pt2_archive``, ``pt2_archive_reweighted``,
``pt2_archive_second_mint``, ``pt2_report`` and the helper
:func:`archive_report`.

Run as ``python -m tests.support.archives mint <out.pt2> [--seed N]`` to mint
archive A's program in a fresh process (what the builder does), and as
``python -m tests.support.archives build`` to fill the cache (these five, then
the transformers archives of ``hf_archives``): a session in several workers
starts that at once (``tests/conftest.py``), so they build while the first
files run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
import pytest
from filelock import FileLock

from cgstore_client.archive import ArchiveReport, inspect

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from torch.export import ExportedProgram

REPO = Path(__file__).resolve().parents[2]
CACHE_ROOT = REPO / ".test-cache" / "archives"
_CLIENT = REPO / "client" / "cgstore_client"
# Every source whose change can change an archive's bytes: the models here, the mint, the program
# serialization and device facts it uses, and the metadata it writes. (The reader is not among them:
# every test reads the cached archives afresh.)
_KEY_SOURCES = (
    Path(__file__).resolve(),
    _CLIENT / "mint.py",
    _CLIENT / "metadata.py",
    _CLIENT / "keys.py",
    _CLIENT / "archive" / "graph.py",
    _CLIENT / "archive" / "device.py",
)

ARCHIVE_A = "tiny.pt2"
ARCHIVE_REWEIGHTED = "tiny-reweighted.pt2"
ARCHIVE_SECOND_MINT = "second-mint.pt2"
ARCHIVE_TIED = "tied.pt2"
ARCHIVE_SIGMOID = "tiny-sigmoid.pt2"
_BUILD_RECORD = "build.json"

#: The dynamic batch dimension's declared range.
BATCH_MIN, BATCH_MAX = 1, 64


def tiny_model(
    seed: int = 0,
    *,
    hidden: int = 4,
    literal: float = 0.5,
    activation: str = "relu",
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """A Linear, a persistent and a non-persistent buffer, a lifted constant and a dict input.

    ``seed`` changes only weight values; the keyword variants change the
    computation (an op, a static shape, an inlined literal, a dtype).
    """
    import torch

    class TinyModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, hidden)
            self.register_buffer("scale", torch.rand(hidden))
            self.register_buffer("table", torch.arange(3, dtype=torch.float32), persistent=False)

        def forward(self, inputs: dict[str, torch.Tensor], offset: torch.Tensor) -> torch.Tensor:
            h = self.lin(inputs["x"]) * self.scale + inputs["y"]
            h = torch.relu(h) if activation == "relu" else torch.sigmoid(h)
            # torch.tensor(...) inside forward becomes a lifted tensor constant: a STATIC binding.
            steps = torch.tensor([float(i + 1) for i in range(hidden)], dtype=h.dtype)
            return h + self.table.sum() * literal + offset + steps

    torch.manual_seed(seed)
    model = TinyModel()
    return model.to(dtype) if dtype is not None else model


def tiny_inputs(
    batch: int = 2, *, hidden: int = 4, keys: tuple[str, str] = ("x", "y"), dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Example (or test) inputs for :func:`tiny_model`: ``({x: [batch, 8], y: [batch, hidden]}, offset[hidden])``."""
    import torch

    generator = torch.Generator().manual_seed(1234 + batch)
    dtype = dtype or torch.float32
    x = torch.randn(batch, 8, generator=generator, dtype=dtype)
    y = torch.randn(batch, hidden, generator=generator, dtype=dtype)
    offset = torch.randn(hidden, generator=generator, dtype=dtype)
    return {keys[0]: x, keys[1]: y}, offset


def tiny_program(
    seed: int = 0,
    *,
    hidden: int = 4,
    literal: float = 0.5,
    activation: str = "relu",
    dtype: torch.dtype | None = None,
    batch_max: int = BATCH_MAX,
    keys: tuple[str, str] = ("x", "y"),
) -> ExportedProgram:
    """Export :func:`tiny_model` with a dynamic batch dim in ``[BATCH_MIN, batch_max]`` on the dict input."""
    import torch

    model = tiny_model(seed, hidden=hidden, literal=literal, activation=activation, dtype=dtype)
    inputs, offset = tiny_inputs(hidden=hidden, keys=keys, dtype=dtype)
    batch = torch.export.Dim("batch", min=BATCH_MIN, max=batch_max)
    key_x, key_y = keys
    dynamic_shapes = ({key_x: {0: batch}, key_y: {0: batch}}, None)
    if keys != ("x", "y"):
        model = _rekeyed(model, keys)
    return torch.export.export(model, (inputs, offset), dynamic_shapes=dynamic_shapes)


def _rekeyed(model: torch.nn.Module, keys: tuple[str, str]) -> torch.nn.Module:
    """Wrap ``model`` so its dict input uses other keys (same computation, other input structure)."""
    import torch

    class Rekeyed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, inputs: dict[str, torch.Tensor], offset: torch.Tensor) -> torch.Tensor:
            return self.inner({"x": inputs[keys[0]], "y": inputs[keys[1]]}, offset)

    return Rekeyed()


def tied_model(seed: int = 0) -> torch.nn.Module:
    """An embedding tied to the LM head (one storage, two names), a non-persistent buffer, a dead parameter."""
    import torch

    class TiedLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = torch.nn.Embedding(16, 8)
            self.lm_head = torch.nn.Linear(8, 16, bias=False)
            self.lm_head.weight = self.wte.weight  # what HF's tie_weights() does
            self.register_buffer("position_ids", torch.arange(6), persistent=False)
            self.pos = torch.nn.Embedding(6, 8)
            self.pooler = torch.nn.Linear(8, 8)  # never called: AOTI needs no value for it

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            positions = self.position_ids[: ids.shape[1]]
            return self.lm_head(self.wte(ids) + self.pos(positions))

    torch.manual_seed(seed)
    return TiedLM()


def tied_inputs(length: int = 4) -> tuple[torch.Tensor]:
    import torch

    return (torch.randint(0, 16, (2, length), generator=torch.Generator().manual_seed(7 + length)),)


def tied_program(seed: int = 0) -> ExportedProgram:
    import torch

    return torch.export.export(tied_model(seed), tied_inputs())


# --------------------------------------------------------------------------
# Building and caching
# --------------------------------------------------------------------------


def cache_key() -> str:
    """Hash of the torch version and every source that decides the archives' bytes."""
    import torch

    hasher = blake3.blake3(f"torch={torch.__version__}\n".encode())
    for source in _KEY_SOURCES:
        hasher.update(f"{source.relative_to(REPO)}\n".encode())
        hasher.update(source.read_bytes())
    return hasher.hexdigest()[:24]


@dataclass(frozen=True)
class BuiltArchives:
    """The session's archives and how they were built."""

    directory: Path
    record: dict[str, object]

    @property
    def base(self) -> Path:
        return self.directory / ARCHIVE_A

    @property
    def reweighted(self) -> Path:
        return self.directory / ARCHIVE_REWEIGHTED

    @property
    def second_mint(self) -> Path:
        return self.directory / ARCHIVE_SECOND_MINT

    @property
    def tied(self) -> Path:
        return self.directory / ARCHIVE_TIED

    @property
    def sigmoid(self) -> Path:
        return self.directory / ARCHIVE_SIGMOID


def mint_tiny(path: Path, seed: int = 0) -> float:
    """Mint :func:`tiny_program` (``seed``) to ``path``; returns the seconds it took."""
    from cgstore_client.mint import package_compiled_graph

    started = time.perf_counter()
    package_compiled_graph(tiny_program(seed), path)
    return time.perf_counter() - started


def _timed_mint(program: ExportedProgram, path: Path) -> float:
    from cgstore_client.mint import package_compiled_graph

    started = time.perf_counter()
    package_compiled_graph(program, path)
    return time.perf_counter() - started


def _mint_in_subprocess(path: Path, scratch: Path) -> float:
    """Mint archive A in a fresh interpreter with its own caches, temp dir and working directory."""
    for name in ("inductor-cache", "triton-cache", "tmp", "cwd"):
        (scratch / name).mkdir(parents=True, exist_ok=True)
    environment = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor-cache"),
        "TRITON_CACHE_DIR": str(scratch / "triton-cache"),
        "TMPDIR": str(scratch / "tmp"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "tests.support.archives", "mint", str(path), "--seed", "0"],
        cwd=scratch / "cwd",
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"subprocess mint failed:\n{completed.stdout}\n{completed.stderr}")
    return time.perf_counter() - started


def build_archives(directory: Path) -> dict[str, object]:
    """Compile the five session archives into ``directory``; returns the build record."""
    directory.mkdir(parents=True, exist_ok=True)
    # The second mint runs in its own interpreter anyway: beside the in-process ones, on the other core (a
    # fresh clone builds all five before any test that needs one can start).
    with concurrent.futures.ThreadPoolExecutor(1) as beside:
        second = beside.submit(_mint_in_subprocess, directory / ARCHIVE_SECOND_MINT, directory / "scratch")
        seconds = {
            ARCHIVE_A: mint_tiny(directory / ARCHIVE_A, seed=0),
            ARCHIVE_REWEIGHTED: mint_tiny(directory / ARCHIVE_REWEIGHTED, seed=1),
            ARCHIVE_TIED: _timed_mint(tied_program(), directory / ARCHIVE_TIED),
            ARCHIVE_SIGMOID: _timed_mint(tiny_program(activation="sigmoid"), directory / ARCHIVE_SIGMOID),
        }
        seconds[ARCHIVE_SECOND_MINT] = second.result()
    shutil.rmtree(directory / "scratch", ignore_errors=True)
    return {"compile_seconds": seconds, "compiles": len(seconds)}


def _prune_stale_builds(keep: str) -> None:
    """Drop cached builds for other keys: their sources no longer exist in this checkout."""
    for entry in CACHE_ROOT.iterdir():
        if entry.is_dir() and entry.name != keep and not entry.name.endswith(".staging"):
            shutil.rmtree(entry, ignore_errors=True)


def ensure_archives() -> BuiltArchives:
    """The cached archives for this key, building them first when the cache is cold."""
    key = cache_key()
    final = CACHE_ROOT / key
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    with FileLock(str(CACHE_ROOT / f"{key}.lock")):
        if not (final / _BUILD_RECORD).is_file():
            staging = CACHE_ROOT / f"{key}.staging"
            shutil.rmtree(staging, ignore_errors=True)
            record = {"key": key, **build_archives(staging)}
            (staging / _BUILD_RECORD).write_text(json.dumps(record, indent=1, sort_keys=True))
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            _prune_stale_builds(keep=key)
            record["cold"] = True
        else:
            record = {**json.loads((final / _BUILD_RECORD).read_text()), "cold": False}
    return BuiltArchives(directory=final, record=record)


@functools.cache
def archive_report(path: Path) -> ArchiveReport:
    """``inspect(path)``, once per path per session."""
    return inspect(path)


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def built_archives() -> BuiltArchives:
    """The session's five real archives (compiled on a cold cache only)."""
    return ensure_archives()


@pytest.fixture(scope="session")
def pt2_archive(built_archives: BuiltArchives) -> Path:
    """Archive A: a real, admissible, weight-free compiled graph of :func:`tiny_program` (seed 0)."""
    return built_archives.base


@pytest.fixture(scope="session")
def pt2_archive_reweighted(built_archives: BuiltArchives) -> Path:
    """The same program with other weights, minted under another file name."""
    return built_archives.reweighted


@pytest.fixture(scope="session")
def pt2_archive_second_mint(built_archives: BuiltArchives) -> Path:
    """Archive A minted again in a subprocess with different cache dirs, TMPDIR and cwd."""
    return built_archives.second_mint


@pytest.fixture(scope="session")
def pt2_archive_tied(built_archives: BuiltArchives) -> Path:
    """:func:`tied_program` minted: ties in its metadata, derived constants beside it."""
    return built_archives.tied


@pytest.fixture(scope="session")
def pt2_archive_sigmoid(built_archives: BuiltArchives) -> Path:
    """:func:`tiny_program` with ``activation="sigmoid"``: archive A's tensors, another computation."""
    return built_archives.sigmoid


@pytest.fixture(scope="session")
def pt2_report(pt2_archive: Path) -> ArchiveReport:
    """``inspect(pt2_archive)``."""
    return archive_report(pt2_archive)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    mint = commands.add_parser("mint", help="mint tiny_program(seed) to a path")
    mint.add_argument("path", type=Path)
    mint.add_argument("--seed", type=int, default=0)
    commands.add_parser("build", help="fill the cache: the session archives, then the transformers ones")
    arguments = parser.parse_args(argv)
    if arguments.command == "build":
        from tests.support.hf_archives import HF_NAMES, hf_archive  # it builds on this module

        record = ensure_archives().record
        for name in HF_NAMES:
            hf_archive(name)
        print(json.dumps({"cold": record["cold"], "compiles": record["compiles"]}))
        return 0
    print(json.dumps({"seconds": mint_tiny(arguments.path, arguments.seed)}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
