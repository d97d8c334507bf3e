"""Fixtures of the console tests: a signed-in browser-like client and a registry with real records in it."""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, sync_playwright

from tests.compiled_graphs.support import (
    CONSTANTS_A,
    Publication,
    publication,
    publish,
    safetensors_bytes,
    unique_envelope,
)
from tests.support.archives import archive_report
from tests.support.live_store import unique_repo

#: A publisher name no page may interpret (a principal's name is any printable text).
HOSTILE = "<script>alert(1)</script>\"'&"
#: A yank reason: markup, quotes, and a non-ASCII letter the audit stores escaped (``\u043e``).
HOSTILE_REASON = "<script>alert(2)</script> \"q\" 'q' r\u043eot <img src=x onerror=alert(3)>"

#: What the free-form fields of :meth:`Registry.publish_hostile_in_the_private_cache`'s record hold: one
#: marker each (as a key and as a value in the evidence), so that each field's escaping is checked.
HOSTILE_FIELDS = {
    "mint phases": "<script>alert('mint')</script>",
    "kernel-lane evidence": "<img src=x onerror=alert('lane')>",
    "layout": "<script>alert('layout')</script>",
    "second publisher": "<img src=x onerror=alert('second')>",
}

CHROMIUM = Path("/usr/bin/chromium")
#: Where the browser tests leave their screenshots (``.test-results`` is the suite's output directory).
SCREENSHOTS = Path(__file__).resolve().parents[2] / ".test-results" / "console"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's chromium, headless, once per module (Playwright's own browser download cannot run here)."""
    assert CHROMIUM.exists(), "make test installs Debian's chromium (make chromium)"
    with sync_playwright() as pw:
        launched = pw.chromium.launch(
            executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox", "--disable-gpu"]
        )
        yield launched
        launched.close()


@contextlib.contextmanager
def sign_in(store, token: str) -> Iterator[httpx.Client]:
    """A client holding the console's cookie for ``token`` (as a browser would after the sign-in form)."""
    with httpx.Client(base_url=store.base_url, timeout=60, follow_redirects=False) as client:
        answer = client.post("/console/login", data={"token": token})
        assert answer.status_code == 303, answer.text
        yield client


def h1(html: str) -> str:
    found = re.findall(r"<h1>(.*?)</h1>", html, re.S)
    assert len(found) == 1, found
    return found[0]


def next_link(html: str) -> str | None:
    found = re.findall(r'<a rel="next" href="([^"]+)">Next</a>', html)
    return found[0].replace("&amp;", "&") if found else None


@pytest.fixture
def admin(store) -> str:
    return store.mint(f"console-admin-{uuid.uuid4().hex[:8]}", "*/*:admin")


@pytest.fixture
def console(store, admin):
    with sign_in(store, admin) as client:
        yield client


@dataclass
class Registry:
    """Three records of one fresh family in one fresh repo (the last by a hostile-named publisher), and one
    record in a private cache."""

    repo: str
    family: str
    publications: list[Publication]
    publisher: str
    private_repo: str
    private: Publication
    #: The hostile-named publisher's token, and what a further record of the family is made from.
    hostile_token: str
    make: Callable[..., Publication]

    def publish_another(self, store, **make) -> Publication:
        """One more record in ``repo`` by the hostile-named publisher, of another family (for a test that
        changes it: the family's counts stay what other tests expect)."""
        pub = self.make(f"{self.family}-more", **make)
        with store.client(self.hostile_token) as client:
            assert publish(client, *self.repo.split("/"), pub).status_code == 201
        return pub

    def publish_hostile_in_the_private_cache(self, store) -> Publication:
        """A record whose every free-form field is hostile (:data:`HOSTILE_FIELDS`), published in ``private_repo``
        by :data:`HOSTILE` and by a second hostile-named publisher: the record page shows both, "Published by"."""
        lane, mint = HOSTILE_FIELDS["kernel-lane evidence"], HOSTILE_FIELDS["mint phases"]
        pub = self.make(
            f"{self.family}-hostile",
            evidence={"kernel_lane_evidence": {lane: {"step_s": lane}}, "mint_phases": {mint: mint}},
            layout={
                "display": HOSTILE_FIELDS["layout"],
                "topology": "blake3:" + "1" * 64,
                "quant": "blake3:" + "2" * 64,
            },
        )
        second = store.mint(HOSTILE_FIELDS["second publisher"], f"{self.private_repo}:read,write")
        for token in (self.hostile_token, second):
            with store.client(token) as client:
                answer = publish(client, *self.private_repo.split("/"), pub)
                assert answer.status_code == 201, answer.text
        return pub

    def yank_another_with_a_hostile_reason(self, store, admin: str) -> Publication:
        """:meth:`publish_another`, then yanked by ``admin`` with :data:`HOSTILE_REASON`."""
        target = self.publish_another(store)
        owner, name = self.repo.split("/")
        with store.client(admin) as client:
            yanked = client.post(
                f"/v1/repos/{owner}/{name}/compiled-graphs/{target.key}:yank",
                json={"reason": HOSTILE_REASON, "publisher": HOSTILE},
            )
        assert yanked.status_code == 200, yanked.text
        return target


@pytest.fixture(scope="module")
def registry(store, pt2_archive) -> Registry:
    """Shared by a module's tests (publishing is slow): a test that changes a record publishes its own."""
    report = archive_report(pt2_archive)
    components = {"consts": safetensors_bytes(CONSTANTS_A)}
    name, private_name = unique_repo("console"), unique_repo("console-private")
    family = f"console-{uuid.uuid4().hex[:8]}"
    publisher = f"pub-{uuid.uuid4().hex[:6]}"
    plain = store.mint(publisher, f"acme/{name}:read,write")
    hostile = store.mint(HOSTILE, f"acme/{name}:read,write", f"acme/{private_name}:read,write,admin")

    def make(family: str = family, *, own_component: bool = False, **manifest_fields) -> Publication:
        """``own_component``: a component no other record binds (its header's metadata makes its bytes unique);
        ``manifest_fields`` replace the manifest's (``evidence``, ``layout``...)."""
        own = {"consts": safetensors_bytes(CONSTANTS_A, {"nonce": uuid.uuid4().hex})} if own_component else components
        return publication(
            pt2_archive, report, components=own, envelope=unique_envelope(), family=family, **manifest_fields
        )

    pubs = [make() for _ in range(3)]
    with store.client(plain) as client:
        for pub in pubs[:2]:
            assert publish(client, "acme", name, pub).status_code == 201
    private = make()
    with store.client(hostile) as client:
        assert publish(client, "acme", name, pubs[2]).status_code == 201
        assert client.put(f"/v1/repos/acme/{private_name}", json={"visibility": "principal"}).status_code == 201
        assert publish(client, "acme", private_name, private).status_code == 201
    return Registry(f"acme/{name}", family, pubs, publisher, f"acme/{private_name}", private, hostile, make)
