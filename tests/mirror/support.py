"""Two stores in one test: an upstream (PostgreSQL + RGW) and a regional mirror of it (either configuration).

The upstream runs in this process with its app wrapped in a ``Tap``, which
records every request it answers and the body bytes it sent, so a test counts
exactly what the upstream served (it streams blob bytes itself,
``redirect_downloads=False``: with presigned redirects the bucket would serve
them out of the tap's sight). The mirror reaches the upstream through a
``CuttableProxy``: cutting it is an upstream outage as the mirror sees one
(connections dropped, new ones refused). ``HostileProxy`` stands between a
mirror and the honest upstream and alters what passes (a blob byte, a
receipt, the JWKS).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn

from cgstore.app import create_app
from cgstore.core import migrate
from cgstore.core.serving import server_options
from cgstore.mirror import trust
from cgstore.settings import Settings
from tests.compiled_graphs.support import CONSTANTS_A, Publication, publication, safetensors_bytes, unique_envelope
from tests.compiled_graphs.support import publish as publish_over
from tests.support import services
from tests.support.live_store import LiveStore, running_store
from tests.support.proxy import CuttableProxy
from tests.support.services import free_port

#: How long a test waits on an upstream that does not answer: short, so outage tests stay fast.
UPSTREAM_TIMEOUT_S = 2.0
#: The owner every mirror test publishes under, and the grants of the tokens involved.
OWNER = "acme"
MIRROR_FAMILY = "mirror-family"


@dataclass
class Served:
    method: str
    path: str
    status: int = 0
    bytes: int = 0


class Tap:
    """ASGI wrapper: every HTTP request answered, with its status and the body bytes sent."""

    def __init__(self, app) -> None:
        self.app = app
        self.served: list[Served] = []
        self._lock = threading.Lock()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        entry = Served(scope["method"], scope["path"])
        with self._lock:
            self.served.append(entry)

        async def tapped(message) -> None:
            if message["type"] == "http.response.start":
                entry.status = message["status"]
            elif message["type"] == "http.response.body":
                entry.bytes += len(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, tapped)

    def blob_bytes(self, digest: str) -> int:
        """Body bytes of blob GETs of ``digest`` the upstream sent."""
        with self._lock:
            return sum(s.bytes for s in self.served if s.method == "GET" and s.path.endswith(f"/blobs/{digest}"))

    def count(self, method: str, suffix: str) -> int:
        with self._lock:
            return sum(1 for s in self.served if s.method == method and s.path.endswith(suffix))


@contextlib.contextmanager
def serving(app, name: str) -> Iterator[tuple[str, uvicorn.Server]]:
    """Run an ASGI app on a loopback port in a thread; its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"{name} did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(15)


@contextlib.contextmanager
def tapped_store(settings: Settings, configuration: str) -> Iterator[tuple[LiveStore, Tap]]:
    """``running_store`` with the app behind a ``Tap``."""
    migrate.upgrade(settings.resolved_database_url)
    app = create_app(settings)
    tap = Tap(app)
    port = free_port()
    config = uvicorn.Config(
        tap, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **server_options(settings)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"upstream-{configuration}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the upstream did not start")
        time.sleep(0.02)
    try:
        yield LiveStore(configuration, f"http://127.0.0.1:{port}", settings, app.state.context, server), tap
    finally:
        server.should_exit = True
        thread.join(15)


@dataclass
class UpstreamStore:
    """The upstream, its tap, an admin token, and what publishing there needs."""

    live: LiveStore
    tap: Tap
    archive: Path
    report: object
    admin: str = ""
    publisher: str = ""
    published: list[Publication] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.live.base_url

    def publish(
        self, repo: str, *, family: str = MIRROR_FAMILY, token: str | None = None, owner: str = OWNER, **fields
    ) -> Publication:
        """A new record of the small real archive (a key no other test uses) in ``<owner>/<repo>``."""
        components = {"consts": safetensors_bytes(CONSTANTS_A)}
        pub = publication(
            self.archive, self.report, components=components, envelope=unique_envelope(), family=family, **fields
        )
        with self.live.client(token or self.publisher) as client:
            response = publish_over(client, owner, repo, pub)
            assert response.status_code == 201, response.text
        self.published.append(pub)
        return pub

    def yank(self, repo: str, key: str, reason: str = "bad graph") -> None:
        with self.live.client(self.admin) as client:
            response = client.post(f"/v1/repos/{OWNER}/{repo}/compiled-graphs/{key}:yank", json={"reason": reason})
            assert response.status_code == 200, response.text

    def jwks(self) -> dict:
        return httpx.get(f"{self.base_url}/v1/keys", timeout=30).json()


@dataclass
class MirrorStore:
    """A mirror, the proxy it reaches the upstream through, and its upstream token (a file)."""

    live: LiveStore
    proxy: object
    upstream_token: str
    worker: str = ""

    @property
    def base_url(self) -> str:
        return self.live.base_url

    @property
    def runtime(self):
        return self.live.context.mirror


def start_mirror(
    stack, request, tmp_path_factory, upstream: UpstreamStore, configuration: str, via: str | None = None, **overrides
):
    """A mirror of ``upstream`` reached through a ``CuttableProxy`` (or at ``via``, e.g. a ``HostileProxy``)."""
    home = tmp_path_factory.mktemp(f"mirror-{configuration}")
    proxy = CuttableProxy(int(upstream.base_url.rsplit(":", 1)[1]))
    stack.callback(proxy.close)
    upstream_token = upstream.live.mint(f"mirror-{configuration}", f"{OWNER}/*:read")
    token_file = home / "upstream-token"
    token_file.write_text(upstream_token + "\n")
    os.chmod(token_file, 0o600)
    overrides.setdefault("upstream_timeout_s", UPSTREAM_TIMEOUT_S)
    overrides.setdefault("mirror_negative_ttl_s", 1.0)
    settings_fields = dict(
        home=home,
        upstream_url=via or f"http://127.0.0.1:{proxy.port}",
        upstream_token_file=token_file,
        reaper_interval_s=3600,
        metrics_token=secrets.token_urlsafe(24),
        console_aggregates_s=0,
        **overrides,
    )
    if configuration == "production":
        s3 = request.getfixturevalue("s3_server")
        services.use_s3_credentials(s3)
        settings_fields["database_url"] = stack.enter_context(services.postgres_database("cgstore_mirror"))
        settings_fields["storage_url"] = s3.storage_url(s3.create_bucket())
    live = stack.enter_context(running_store(Settings(**settings_fields), configuration))
    trust_upstream(live, upstream.base_url)
    mirror = MirrorStore(live=live, proxy=proxy, upstream_token=upstream_token)
    mirror.worker = live.mint("worker", f"{OWNER}/*:read")
    return mirror


def trust_upstream(mirror: LiveStore, upstream_url: str) -> str:
    """What ``cgstore mirror trust`` does, in process: the upstream's keys trusted; their fingerprint."""
    jwks = httpx.get(f"{upstream_url}/v1/keys", timeout=30).json()
    return trust.record_trust(mirror.context.db, upstream_url, jwks, expect=None, how="test")


def resolve(client: httpx.Client, key: str, family: str = MIRROR_FAMILY) -> dict:
    response = client.post("/v1/compiled-graphs:resolve", json={"family": family, "keys": [key]})
    assert response.status_code == 200, response.text
    return response.json()["answers"][0]


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# -- a hostile upstream ------------------------------------------------------------------------


class HostileProxy:
    """An HTTP proxy to the upstream (an ASGI app) whose ``alter(path, body) -> body`` rewrites answers."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.alter: Callable[[str, bytes], bytes] = lambda path, body: body
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")}
        path = scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        async with httpx.AsyncClient(base_url=self.target, timeout=30) as client:
            answer = await client.request(scope["method"], path, headers=headers, content=body)
        content = answer.content if scope["method"] == "HEAD" else self.alter(scope["path"], answer.content)
        skip = {"content-length", "transfer-encoding", "content-encoding", "connection"}
        out = [(k.encode(), v.encode()) for k, v in answer.headers.items() if k.lower() not in skip]
        length = answer.headers.get("content-length", "0") if scope["method"] == "HEAD" else str(len(content))
        out.append((b"content-length", length.encode()))
        await send({"type": "http.response.start", "status": answer.status_code, "headers": out})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else content})
