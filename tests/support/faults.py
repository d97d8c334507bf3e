"""Dependencies the fault suite can really stop: a private PostgreSQL cluster and an S3 front.

The machine's PostgreSQL is shared by the whole test session, so stopping it
would fail every other test: the fault suite runs its own throwaway cluster
(``initdb`` into a temp directory, as the ``postgres`` user when we are root)
and stops it with ``pg_ctl -m immediate`` — the way a crash or a kill -9 of
the database looks to the store. The session's S3 (Ceph's RADOS Gateway) is
shared by the whole session too, and takes seconds to restart; the store instead
reaches it through a :class:`~tests.support.proxy.CuttableProxy`, and
"stopping S3" closes that door (every connection dropped, new ones refused),
which is what the store sees when the S3 server goes away.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.proxy import CuttableProxy
from tests.support.services import S3Server, free_port, wait_for_port


def _pg_bin(name: str) -> str:
    versions = sorted(os.listdir("/usr/lib/postgresql"))
    return str(Path("/usr/lib/postgresql") / versions[-1] / "bin" / name)


def _as_postgres(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: drop to the ``postgres`` user when we are root."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@dataclass
class PrivatePostgres:
    """A PostgreSQL cluster of our own, on a free loopback port, that tests may stop and start."""

    root: Path
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/cgstore"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(
            _as_postgres(
                [_pg_bin("pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start"]
            ),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    def stop(self) -> None:
        """Stop at once, as a crash would (no checkpoint, clients cut)."""
        subprocess.run(
            _as_postgres([_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"]),
            check=True,
            stdout=subprocess.DEVNULL,
        )


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    root = Path(tempfile.mkdtemp(prefix="cgstore-faults-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    pg = PrivatePostgres(root, free_port())
    subprocess.run(
        _as_postgres([_pg_bin("initdb"), "-D", str(pg.data), "-A", "trust", "-U", "postgres", "--no-sync"]),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    pg.start()
    try:
        subprocess.run(
            _as_postgres([_pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres", "cgstore"]),
            check=True,
        )
        yield pg
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            pg.stop()
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class StoppableS3:
    """The session's S3 behind a door the test can close."""

    server: S3Server
    proxy: CuttableProxy
    bucket: str

    @property
    def storage_url(self) -> str:
        return f"s3://{self.bucket}?endpoint_url=http://127.0.0.1:{self.proxy.port}&region={self.server.region}"

    def stop(self) -> None:
        self.proxy.cut()

    def start(self) -> None:
        self.proxy.restore()


@contextlib.contextmanager
def stoppable_s3(server: S3Server) -> Iterator[StoppableS3]:
    proxy = CuttableProxy(int(server.endpoint_url.rsplit(":", 1)[1]))
    try:
        yield StoppableS3(server, proxy, server.create_bucket())
    finally:
        proxy.close()


def wait_until_ready(base_url: str, timeout_s: float = 30.0) -> float:
    """Seconds until ``/readyz`` answers 200 again; fails the test after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200:
                return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"the store did not recover within {timeout_s}s")
