"""A store running for real (uvicorn on a loopback port, in a thread), in either configuration.

``embedded``: SQLite + a local directory (the default a newcomer runs).
``production``: PostgreSQL (a fresh database of the machine's cluster) + S3
(Ceph's RADOS Gateway, in its own processes, reached through boto3 over HTTP).
Every API test takes the ``store`` fixture and so runs against both.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from cgstore.app import create_app
from cgstore.context import StoreContext
from cgstore.core import migrate
from cgstore.core.serving import server_options
from cgstore.settings import Settings
from tests.support.services import S3Server, free_port, use_s3_credentials

CONFIGURATIONS = ("embedded", "production")


@dataclass
class LiveStore:
    configuration: str
    base_url: str
    settings: Settings
    context: StoreContext
    server: uvicorn.Server

    def client(self, token: str | None = None, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60, **kwargs)

    def mint(self, sub: str, *grants: str, ttl_s: int = 3600, platform: bool = False) -> str:
        """A token for ``sub`` with CLI-spelled grants like ``'acme/*:read,write'``."""
        return self.context.tokens.mint(sub, list(grants), ttl_s, platform=platform).token

    def metrics_headers(self) -> dict[str, str]:
        """The header ``GET /metrics`` requires: the store's metrics token."""
        return {"Authorization": f"Bearer {self.settings.metrics_token.get_secret_value()}"}

    def scrape_metrics(self) -> str:
        """``GET /metrics`` with the metrics token: the Prometheus text."""
        response = httpx.get(f"{self.base_url}/metrics", headers=self.metrics_headers(), timeout=60)
        response.raise_for_status()
        return response.text

    @property
    def is_s3(self) -> bool:
        return self.settings.storage_is_s3


def unique_repo(prefix: str = "r") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def running_store(settings: Settings, configuration: str) -> Iterator[LiveStore]:
    migrate.upgrade(settings.resolved_database_url)
    app = create_app(settings)
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **server_options(settings)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"store-{configuration}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the store did not start")
        time.sleep(0.02)
    try:
        yield LiveStore(configuration, f"http://127.0.0.1:{port}", settings, app.state.context, server)
    finally:
        server.should_exit = True
        thread.join(15)


def session_servers(request, configuration: str) -> dict:
    """``settings_for``'s servers for a store on the session database: the database and its bucket."""
    if configuration != "production":
        return {"pg_url": None, "s3": None}
    return {
        "pg_url": request.getfixturevalue("pg_url"),
        "s3": request.getfixturevalue("s3_server"),
        "bucket": request.getfixturevalue("session_bucket"),
    }


def settings_for(
    configuration: str,
    home: Path,
    *,
    pg_url: str | None,
    s3: S3Server | None,
    bucket: str | None = None,
    **overrides,
) -> Settings:
    """A test store's settings; in production, ``bucket`` (else a new one) on ``s3``.

    A database and a bucket go together: a store that shares a database must share
    its bucket too, or the blob rows it meets name bytes its bucket lacks.
    """
    # The reaper runs only when a test asks for it: its sweep of a shared bucket would
    # take a concurrent test's in-flight upload (of another store) for an orphan.
    overrides.setdefault("reaper_interval_s", 3600)
    # /metrics is closed without a token; every test store has one so tests can scrape it.
    overrides.setdefault("metrics_token", secrets.token_urlsafe(24))
    # The console's overview figures live on every view: tests publish and look at once.
    overrides.setdefault("console_aggregates_s", 0)
    if configuration == "embedded":
        return Settings(home=home, **overrides)
    use_s3_credentials(s3)
    bucket = bucket or s3.create_bucket()
    return Settings(home=home, database_url=pg_url, storage_url=s3.storage_url(bucket), **overrides)
