"""Shared plumbing of the bench scripts: backing services, the store process, RSS and CPU sampling.

Services are started exactly the way the tests start them (``tests/support/services.py``):
a fresh PostgreSQL database (created, then dropped), a single-host Ceph cluster whose
RADOS Gateway (S3) listens on a free loopback port, and ``cgstore serve`` as a separate process configured through
the same ``CGSTORE_*`` variables a deployment uses. Every bench script prints
details on earlier lines and exactly one JSON object on its last line.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.support import services  # noqa: E402  (needs the repo root on sys.path)

MiB = 1 << 20
GiB = 1 << 30


def log(*parts: object) -> None:
    """A detail line (never the last line: that one is the JSON result)."""
    print(*parts, flush=True)


def emit_result(result: dict) -> None:
    """The script's last line: exactly one JSON object."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=False), flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values)


# -- memory and CPU of other processes ---------------------------------------------------


class RssSampler:
    """Samples a process's RSS every ``interval_s`` in a background thread; keeps the peak."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self._process = psutil.Process(pid)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_bytes = 0
        self.samples = 0

    def sample(self) -> int:
        rss = self._process.memory_info().rss
        self.peak_bytes = max(self.peak_bytes, rss)
        self.samples += 1
        return rss

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                self.sample()
            self._stop.wait(self._interval_s)

    def __enter__(self) -> RssSampler:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(psutil.Error):
            self.sample()

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / MiB


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MiB


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (threads included)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


@dataclass
class Timing:
    """Wall time of a block and the CPU time each watched process spent in it."""

    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def timed(watch: dict[str, int]) -> Iterator[Timing]:
    """``with timed({"server": pid, **stack.s3.pids, "client": os.getpid()}) as t: ...``"""
    timing = Timing()
    before = {name: cpu_seconds(pid) for name, pid in watch.items()}
    start = time.perf_counter()
    yield timing
    timing.wall_s = time.perf_counter() - start
    timing.cpu_s = {name: cpu_seconds(pid) - before[name] for name, pid in watch.items()}


# -- test data ------------------------------------------------------------------------------


def write_random_file(path: Path, size: int, block_bytes: int = 16 * MiB) -> None:
    """``size`` random bytes, generated a block at a time (never the whole file in memory)."""
    with open(path, "wb") as out:
        remaining = size
        while remaining:
            n = min(block_bytes, remaining)
            out.write(os.urandom(n))
            remaining -= n


def blake3_file(path: Path) -> str:
    """``blake3:<hex>`` of a file, multi-threaded over an mmap (not meant to be timed)."""
    import blake3

    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:
        hasher.update_mmap(str(path))
    return "blake3:" + hasher.hexdigest()


# -- raw boto3 download baselines -----------------------------------------------------------


def s3_get_unverified(s3, bucket: str, key: str, dest: Path) -> int:
    """boto3 ``get_object`` streamed into ``dest``, checking nothing and syncing nothing.

    The floor of a download: what the client's verified download costs on top of
    it is verification and durability, not the client. Returns the bytes written.
    """
    body = s3.get_object(Bucket=bucket, Key=key)["Body"]
    received = 0
    with open(dest, "wb") as out:
        for chunk in body.iter_chunks(MiB):
            out.write(chunk)
            received += len(chunk)
    return received


def s3_get_verified(s3, bucket: str, key: str, dest: Path, digest: str, size: int) -> None:
    """boto3 doing by hand what the client's verified download does: the fair baseline.

    ``get_object`` into a temp file in ``dest``'s directory, blake3 of the stream
    while writing it (single-threaded, as the client hashes a stream), fsync, and
    only on a digest and size match a rename into place and an fsync of the
    directory so the rename is durable too. (The client also writes a small
    stamp file per blob: its cache's bookkeeping, not part of this baseline.)
    """
    import blake3

    temp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    hasher = blake3.blake3()
    received = 0
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"]
        with open(temp, "wb") as out:
            for chunk in body.iter_chunks(MiB):
                hasher.update(chunk)
                out.write(chunk)
                received += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        actual = "blake3:" + hasher.hexdigest()
        if actual != digest or received != size:
            raise SystemExit(
                f"verified baseline: {received} bytes hashing to {actual}, expected {digest} ({size} bytes)"
            )
        os.replace(temp, dest)
        directory = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()


def read_chunks(path: Path, chunk_bytes: int = MiB) -> Iterator[bytes]:
    with open(path, "rb") as source:
        while chunk := source.read(chunk_bytes):
            yield chunk


# -- the running stack ----------------------------------------------------------------------


@dataclass
class _StoreProcessStack:
    """A store running as its own process: its URL, its pid, and tokens minted by its CLI."""

    store: services.StoreProcess

    @property
    def base_url(self) -> str:
        return self.store.base_url

    @property
    def server_pid(self) -> int:
        return self.store.process.pid

    def mint(self, sub: str, *grants: str, ttl: str = "1h") -> str:
        """A token minted by the store's own CLI, in the store's environment."""
        return mint_token(self.store.env, sub, *grants, ttl=ttl)


@dataclass
class Stack(_StoreProcessStack):
    """PostgreSQL database + S3 (Ceph's RADOS Gateway) + a bucket + the store process using them."""

    s3: services.S3Server
    bucket: str
    database_url: str
    home: Path

    @property
    def s3_pids(self) -> dict[str, int]:
        """The S3's processes by name (monitor, OSD, gateway), for CPU and RSS figures."""
        return self.s3.pids


def mint_token(env: dict[str, str], sub: str, *grants: str, ttl: str = "1h") -> str:
    """A token minted by the store's own CLI in the store's environment ``env``."""
    args = [sys.executable, "-m", "cgstore.cli", "token", "mint", "--sub", sub, "--ttl", ttl]
    for grant in grants:
        args += ["--grant", grant]
    done = subprocess.run(args, env=env, cwd=REPO_ROOT, check=True, capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1]


@dataclass
class EmbeddedStack(_StoreProcessStack):
    """The store in its embedded default (SQLite + a blob directory under its home), as a process."""

    home: Path


@contextlib.contextmanager
def embedded_stack(**settings: object) -> Iterator[EmbeddedStack]:
    """``cgstore serve`` with nothing but a fresh ``CGSTORE_HOME``: SQLite and the directory
    backend (blob GETs are answered by the store itself, never redirected); removed after."""
    with tempfile.TemporaryDirectory(prefix="cgstore-bench-home-") as home_dir:
        env = {f"CGSTORE_{name.upper()}": _env_value(value) for name, value in settings.items()}
        with services.store_process(env, Path(home_dir)) as store:
            yield EmbeddedStack(store=store, home=Path(home_dir))


@contextlib.contextmanager
def production_stack(prefix: str = "cgstore_bench", **settings: object) -> Iterator[Stack]:
    """Start PostgreSQL (database created here, dropped after), Ceph's RADOS Gateway
    and the store (PostgreSQL + S3) as a separate process; stop and drop everything after.

    ``settings`` are extra store options by field name (``redirect_downloads=True``),
    passed as ``CGSTORE_<NAME>`` variables like any deployment would.
    """
    with replicated_stack(prefix, replicas=1, **settings) as replicated:
        yield replicated.stacks[0]


@dataclass
class ReplicatedStack:
    """Several store processes on one PostgreSQL database, one bucket and one ``CGSTORE_HOME``."""

    stacks: list[Stack]

    @property
    def base_urls(self) -> list[str]:
        return [stack.base_url for stack in self.stacks]

    @property
    def server_pids(self) -> list[int]:
        return [stack.server_pid for stack in self.stacks]

    def mint(self, sub: str, *grants: str, ttl: str = "1h") -> str:
        """A token every replica accepts (they share the database that holds the signing keys)."""
        return self.stacks[0].mint(sub, *grants, ttl=ttl)


@contextlib.contextmanager
def replicated_stack(prefix: str = "cgstore_bench", replicas: int = 2, **settings: object) -> Iterator[ReplicatedStack]:
    """Like :func:`production_stack`, with ``replicas`` store processes behind no load
    balancer: each on its own loopback port, all sharing the database, the bucket and
    the home directory (hence the signing key), the way replicas of one deployment do.
    Replicas start one after the other, so only the first creates the signing key.
    """
    with contextlib.ExitStack() as stack:
        database_url = stack.enter_context(services.postgres_database(prefix))
        s3 = stack.enter_context(services.rgw_s3_server())
        bucket = s3.create_bucket()
        home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cgstore-bench-home-")))
        env = {
            "CGSTORE_DATABASE_URL": database_url,
            "CGSTORE_STORAGE_URL": s3.storage_url(bucket),
            **s3.credentials,
            **{f"CGSTORE_{name.upper()}": _env_value(value) for name, value in settings.items()},
        }
        stores = [stack.enter_context(services.store_process(env, home)) for _ in range(replicas)]
        yield ReplicatedStack(
            [Stack(store=store, s3=s3, bucket=bucket, database_url=database_url, home=home) for store in stores]
        )


def _env_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
