"""The conformance suite's one fixture: a deployment, black-box, reached only over HTTP.

Pointed at a real deployment::

    CGSTORE_URL=https://cgstore.internal CGSTORE_ADMIN_TOKEN=… make conformance

it runs every test once against that URL (comma-separate several replicas'
URLs to spread requests over them) and writes junit XML. Without
``CGSTORE_URL`` — inside ``make test`` — it runs each test against three local
deployments: the embedded default, PostgreSQL + S3, and two replicas sharing
one PostgreSQL and one bucket with requests alternating between them.

Nothing here imports the server except to *start* the local deployments and
mint their first admin token (what an operator does with the CLI); the tests
themselves speak only HTTP, so they certify whatever answers at the URL.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

LOCAL_DEPLOYMENTS = ("embedded", "production", "replicas")


class RoundRobin(httpx.BaseTransport):
    """Sends each request to the next replica in turn: a load balancer without affinity."""

    def __init__(self, urls: list[str]) -> None:
        self._front = httpx.URL(urls[0])
        self._next = itertools.cycle([httpx.URL(url) for url in urls])
        self._inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if (request.url.host, request.url.port) == (self._front.host, self._front.port):
            target = next(self._next)  # a followed redirect to storage goes where it points
            request.url = request.url.copy_with(scheme=target.scheme, host=target.host, port=target.port)
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


@dataclass
class Deployment:
    """What the suite knows about the store under test: its URLs and an admin token."""

    name: str
    urls: list[str]
    admin_token: str
    #: Local deployments mint as their operator would (the CLI's code path); remote ones over HTTP.
    local_mint: Callable[..., str] | None = None

    def client(self, token: str | None = None, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(
            base_url=self.urls[0], headers=headers, timeout=60, transport=RoundRobin(self.urls), **kwargs
        )

    def mint(self, sub: str, *grants: str, ttl_s: int = 3600, platform: bool = False) -> str:
        """A token for ``sub``, e.g. ``mint("ci", "acme/*:read,write")``, minted by the deployment."""
        if self.local_mint is not None:
            return self.local_mint(sub, *grants, ttl_s=ttl_s, platform=platform)
        body = {"sub": sub, "grants": [_grant(g) for g in grants], "ttl_s": ttl_s, "platform": platform}
        with self.client(self.admin_token) as client:
            answer = client.post("/v1/tokens", json=body)
        assert answer.status_code == 201, answer.text
        return answer.json()["token"]


def _grant(spelled: str) -> dict:
    pattern, _, actions = spelled.partition(":")
    return {"repo": pattern, "actions": actions.split(",")}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "deployment" in metafunc.fixturenames:
        names = ["remote"] if os.environ.get("CGSTORE_URL") else list(LOCAL_DEPLOYMENTS)
        metafunc.parametrize("deployment", names, indirect=True, scope="session")


@pytest.fixture(scope="session")
def deployment(request) -> Iterator[Deployment]:
    if request.param == "remote":
        urls = [u.strip().rstrip("/") for u in os.environ["CGSTORE_URL"].split(",") if u.strip()]
        yield Deployment("remote", urls, os.environ["CGSTORE_ADMIN_TOKEN"])
        return
    from tests.conformance.local import local_deployment

    with local_deployment(request, request.param) as local:
        yield local
