"""Preheat (issue 27 §1): with ``CGSTORE_MIRROR_PREHEAT=1`` a record published upstream is on the mirror before
any worker asks; one the filters refuse is not pulled (no blob crosses)."""

from __future__ import annotations

import blake3
import pytest
from sqlalchemy import select

from cgstore.compiled_graphs.models import CompiledGraph
from tests.mirror.support import OWNER, resolve, wait_until
from tests.support.live_store import CONFIGURATIONS, unique_repo


def mirrored(mirror, key: str) -> CompiledGraph | None:
    """The mirror's own row of ``key`` (read from its database: asking over HTTP would pull it)."""
    with mirror.live.context.db.session() as session:
        return session.scalar(select(CompiledGraph).where(CompiledGraph.key == key))


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_a_record_published_upstream_is_on_the_mirror_before_any_worker_asks(upstream, make_mirror, configuration):
    mirror = make_mirror(configuration, mirror_preheat=True, mirror_families="mirror-*")
    ctx = mirror.live.context
    repo = unique_repo("preheat")
    # Every test publishes the same small archive: what this mirror pulled is the tap's count's growth.
    artifact = "blake3:" + blake3.blake3(upstream.archive.read_bytes()).hexdigest()
    sent_before = upstream.tap.blob_bytes(artifact)
    pub = upstream.publish(repo)
    assert pub.artifact.digest == artifact
    skipped = upstream.publish(repo, family="other-family")
    wait_until(lambda: mirrored(mirror, pub.key) is not None, 20, "the preheat")
    row = mirrored(mirror, pub.key)
    assert row.origin is not None and row.yanked_at is None
    # Pulled by the follower alone: no worker asked the mirror anything yet.
    assert ctx.metrics.mirror_preheats.labels("pulled")._value.get() == 1
    assert upstream.tap.blob_bytes(pub.artifact.digest) - sent_before == pub.artifact.size
    # The filtered family was announced too, and left upstream.
    wait_until(lambda: ctx.metrics.mirror_preheats.labels("filtered")._value.get() == 1, 10, "the filtered event")
    assert mirrored(mirror, skipped.key) is None
    # A worker now resolves it from the mirror's own rows: the upstream sends the blob no second time.
    with mirror.live.client(mirror.worker) as client:
        assert resolve(client, pub.key)["status"] == "hit"
        got = client.get(f"/v1/repos/{OWNER}/{repo}/blobs/{pub.artifact.digest}", follow_redirects=True)
        assert got.status_code == 200 and len(got.content) == pub.artifact.size
    assert upstream.tap.blob_bytes(pub.artifact.digest) - sent_before == pub.artifact.size
