"""A cold mirror pulls a record once, verified, and serves it (issue 27 §2: 8 workers, each blob served once)."""

from __future__ import annotations

from tests.mirror.support import OWNER, resolve
from tests.support.live_store import unique_repo


def test_a_resolve_miss_is_pulled_from_the_upstream_and_served(upstream, mirror):
    repo = unique_repo("pull")
    pub = upstream.publish(repo)
    with mirror.live.client(mirror.worker) as client:
        hit = resolve(client, pub.key)
        assert hit["status"] == "hit", hit
        assert hit["repo"] == f"{OWNER}/{repo}"
        assert hit["artifact"]["digest"] == pub.artifact.digest
        record = client.get(pub.path(OWNER, repo))
        assert record.status_code == 200, record.text
    with upstream.live.client(upstream.publisher) as client:
        original = client.get(pub.path(OWNER, repo)).json()
    # The upstream's receipt, unchanged: it verifies against the upstream's keys.
    assert hit["receipt"] == original["receipt"] == record.json()["receipt"]
