"""Real backing services for tests and benchmarks: PostgreSQL, moto_server (S3), a store.

Tests and ``bench/`` scripts start what they need through these helpers and
stop what they started. PostgreSQL is the machine's own cluster (started if it
is down); each run creates its own database and drops only that one.
``moto_server`` runs as a separate process on a free loopback port and is
reached through real boto3 over HTTP.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

PG_ADMIN_URL = os.environ.get("CGSTORE_TEST_PG_ADMIN", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s}s")


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- PostgreSQL ---------------------------------------------------------------

def postgres_is_up() -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", 5432), timeout=1):
        return True
    return False


def ensure_postgres() -> None:
    """Start the machine's PostgreSQL cluster if it is not answering."""
    if postgres_is_up():
        return
    versions = sorted(os.listdir("/etc/postgresql"))
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "start"], check=True
    )
    wait_for_port(5432, timeout_s=60)


@contextlib.contextmanager
def postgres_database(prefix: str = "cgstore_test", options: str = "") -> Iterator[str]:
    """Create a fresh database (``CREATE DATABASE … options``), yield its SQLAlchemy URL, drop it (only it) afterwards."""
    from sqlalchemy import create_engine, text

    ensure_postgres()
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" {options}'))
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# -- S3 (moto_server) ------------------------------------------------------------

@dataclass
class S3Server:
    endpoint_url: str
    process: subprocess.Popen
    region: str = "us-east-1"

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"cgstore-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def storage_url(self, bucket: str) -> str:
        return f"s3://{bucket}?endpoint_url={self.endpoint_url}&region={self.region}"


S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_s3_server(port: int | None = None) -> Iterator[S3Server]:
    """Run ``moto_server`` on a free loopback port for the duration of the block."""
    port = port or free_port()
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **S3_ENV},
    )
    try:
        wait_for_port(port, proc=proc)
        yield S3Server(endpoint_url=f"http://127.0.0.1:{port}", process=proc)
    finally:
        stop_process(proc)


def use_test_aws_credentials() -> None:
    """boto3 in this process (the store under test) signs with the moto test credentials."""
    for key, value in S3_ENV.items():
        os.environ.setdefault(key, value)


# -- the store as a separate process ----------------------------------------------

@dataclass
class StoreProcess:
    base_url: str
    process: subprocess.Popen
    env: dict


@contextlib.contextmanager
def store_process(env: dict[str, str], home: Path) -> Iterator[StoreProcess]:
    """Migrate and run ``cgstore serve`` in its own process (benchmarks, kill tests)."""
    port = free_port()
    full_env = {
        **os.environ,
        **S3_ENV,
        **env,
        "CGSTORE_HOME": str(home),
        "CGSTORE_HOST": "127.0.0.1",
        "CGSTORE_PORT": str(port),
        "CGSTORE_LOG_LEVEL": "warning",
    }
    cli = [sys.executable, "-m", "cgstore.cli"]
    subprocess.run([*cli, "db", "upgrade"], env=full_env, check=True, cwd=REPO_ROOT)
    proc = subprocess.Popen([*cli, "serve"], env=full_env, cwd=REPO_ROOT)
    try:
        wait_for_port(port, proc=proc)
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while httpx.get(f"{base_url}/readyz").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("store never became ready")
            time.sleep(0.1)
        yield StoreProcess(base_url=base_url, process=proc, env=full_env)
    finally:
        stop_process(proc)
