"""Upstream down: the mirror serves everything it holds, answers other keys as misses that say so, at once,
stays ready and shows itself degraded; upstream back, it pulls again (issue 27 §1 "upstream down", §2)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.mirror.support import MIRROR_FAMILY, OWNER, UPSTREAM_TIMEOUT_S, resolve
from tests.support.live_store import unique_repo


@pytest.fixture(scope="module")
def held_and_not(upstream, mirror):
    """A record the mirror pulled (and its blobs), and one published upstream that it never saw."""
    repo = unique_repo("outage")
    held, unseen = upstream.publish(repo), upstream.publish(repo)
    with mirror.live.client(mirror.worker, follow_redirects=True) as client:
        assert resolve(client, held.key)["status"] == "hit"
    return repo, held, unseen


def _declaration(pub) -> dict:
    axes = pub.manifest["axes"]
    return {"family": MIRROR_FAMILY, "envelope": axes["envelope"], "sm": axes["sm"], "toolchain": axes["toolchain"]}


def test_upstream_down_the_mirror_serves_what_it_holds_and_says_why_it_misses(upstream, mirror, held_and_not):
    repo, held, unseen = held_and_not
    mirror.proxy.cut()
    try:
        with mirror.live.client(mirror.worker, follow_redirects=True) as client:
            hit = resolve(client, held.key)
            assert hit["status"] == "hit"
            discovered = client.post("/v1/compiled-graphs:discover", json=_declaration(held)).json()
            assert [c["key"] for c in discovered["candidates"]] == [held.key]
            for blob in [hit["artifact"], *hit["components"]]:
                # A presigned URL (the production mirror's bucket) carries its own authorization.
                url = blob["url"]
                assert (httpx.get(url) if url.startswith("http") else client.get(url)).status_code == 200
            assert client.get(held.path(OWNER, repo)).status_code == 200

            started = time.monotonic()
            assert resolve(client, unseen.key) == {
                "key": unseen.key,
                "status": "miss",
                "detail": {"upstream": "unavailable"},
            }
            record = client.get(unseen.path(OWNER, repo))
            assert record.status_code == 404 and record.json()["error"]["detail"]["upstream"] == "unavailable"
            nothing = client.post("/v1/compiled-graphs:discover", json=_declaration(unseen)).json()
            assert nothing == {"candidates": [], "detail": {"upstream": "unavailable"}}
            # Never a hang: each miss is answered within the bounded upstream timeout.
            assert time.monotonic() - started < 3 * UPSTREAM_TIMEOUT_S + 1

        assert httpx.get(f"{mirror.base_url}/readyz").status_code == 200
        health = httpx.get(f"{mirror.base_url}/healthz")
        assert health.status_code == 200
        assert health.json()["status"] == "degraded" and health.json()["mirror"]["reachable"] is False
        assert "cgstore_mirror_upstream_up 0.0" in mirror.live.scrape_metrics()
    finally:
        mirror.proxy.restore()

    # Upstream back: the next miss past the retry interval asks it again, and pulls.
    def pulled() -> bool:
        with mirror.live.client(mirror.worker) as client:
            return resolve(client, unseen.key)["status"] == "hit"

    deadline = time.monotonic() + 30  # generous: a loaded machine, and the 2 s retry interval
    while not pulled():
        assert time.monotonic() < deadline, "the mirror did not pull again after the outage"
        time.sleep(0.5)
    assert httpx.get(f"{mirror.base_url}/healthz").json()["status"] == "ok"
    assert "cgstore_mirror_upstream_up 1.0" in mirror.live.scrape_metrics()
