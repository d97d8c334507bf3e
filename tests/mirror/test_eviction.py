"""Eviction (issue 27 §1): a mirror is a cache. GC evicts mirrored records whose blobs no download served for
``CGSTORE_MIRROR_EVICT_AFTER``, their blobs go with the ordinary rules, and the next resolve pulls them again."""

from __future__ import annotations

import dataclasses
import datetime as dt

from sqlalchemy import select, update

from cgstore.blobs.models import Blob
from cgstore.compiled_graphs.models import CompiledGraph
from cgstore.core.db import utcnow
from cgstore.mirror import eviction
from cgstore.operations import gc, leases
from tests.mirror.support import OWNER, resolve
from tests.support.live_store import unique_repo

EVICT_AFTER_S = 3600


def evicting(mirror):
    """The mirror's context with ``CGSTORE_MIRROR_EVICT_AFTER`` set (what its GC round would run with)."""
    ctx = mirror.live.context
    return dataclasses.replace(ctx, settings=ctx.settings.model_copy(update={"mirror_evict_after": EVICT_AFTER_S}))


def live_row(mirror, key: str) -> CompiledGraph | None:
    with mirror.live.context.db.session() as session:
        return session.scalar(select(CompiledGraph).where(CompiledGraph.key == key, CompiledGraph.yanked_at.is_(None)))


def age_blobs(mirror, digests: list[str], seconds: int) -> None:
    """Pretend the blobs were stored (and last served) ``seconds`` ago."""
    long_ago = utcnow() - dt.timedelta(seconds=seconds)
    with mirror.live.context.db.session() as session:
        session.execute(
            update(Blob)
            .where(Blob.digest.in_(digests))
            .values(created_at=long_ago, linked_at=long_ago, last_served_at=None)
        )


def test_unused_mirrored_records_are_evicted_and_pulled_again_on_demand(upstream, mirror):
    ctx = evicting(mirror)
    used_repo, unused_repo = unique_repo("used"), unique_repo("unused")
    used, unused = upstream.publish(used_repo), upstream.publish(unused_repo)
    with mirror.live.client(mirror.worker) as client:
        assert resolve(client, used.key)["status"] == "hit"
        assert resolve(client, unused.key)["status"] == "hit"
    digests = [used.artifact.digest, *(blob.digest for blob in used.components.values())]
    age_blobs(mirror, digests, 2 * EVICT_AFTER_S)
    # Nothing served either for longer than the window: both would go. A download keeps its record.
    with mirror.live.client(mirror.worker) as client:
        got = client.get(f"/v1/repos/{OWNER}/{used_repo}/blobs/{used.artifact.digest}")
        assert got.status_code in (200, 307), got.text
    # The two records share their blobs (the same small archive): the used one keeps them, so both stay...
    assert eviction.evict(ctx).records == 0
    assert live_row(mirror, used.key) is not None and live_row(mirror, unused.key) is not None
    # ...until the window has passed for the download too: the GC round (under its lease) evicts both, then
    # collects their blobs by the ordinary rules (no record names them; linked long ago; no grace here).
    age_blobs(mirror, digests, 2 * EVICT_AFTER_S)
    round_ctx = dataclasses.replace(ctx, settings=ctx.settings.model_copy(update={"gc_grace_s": 0}))
    lease = leases.acquire(ctx.db, leases.GC, "eviction-test", 60)
    try:
        deleted = gc.collect_garbage(round_ctx, lease)
    finally:
        lease.release()
    assert live_row(mirror, used.key) is None and live_row(mirror, unused.key) is None
    assert deleted >= len(digests)
    with ctx.db.session() as session:
        assert session.scalars(select(Blob.digest).where(Blob.digest.in_(digests))).all() == []
    # On demand: a worker's resolve misses here, the mirror pulls it again, and its bytes download.
    sent_before = upstream.tap.blob_bytes(used.artifact.digest)
    with mirror.live.client(mirror.worker) as client:
        assert resolve(client, used.key)["status"] == "hit"
        got = client.get(f"/v1/repos/{OWNER}/{used_repo}/blobs/{used.artifact.digest}", follow_redirects=True)
        assert got.status_code == 200 and len(got.content) == used.artifact.size
    assert upstream.tap.blob_bytes(used.artifact.digest) - sent_before == used.artifact.size


def test_eviction_is_off_by_default_and_never_takes_what_the_store_admitted_itself(upstream, mirror):
    ctx = mirror.live.context
    assert ctx.settings.mirror_evict_after == 0
    repo = unique_repo("kept")
    pub = upstream.publish(repo)
    with mirror.live.client(mirror.worker) as client:
        assert resolve(client, pub.key)["status"] == "hit"
    far_future = utcnow() + dt.timedelta(days=3650)
    assert eviction.evict(ctx, now=far_future).records == 0
    # With eviction on, a row this store admitted (origin NULL) is never a candidate.
    with ctx.db.session() as session:
        session.execute(update(CompiledGraph).where(CompiledGraph.key == pub.key).values(origin=None))
    assert pub.key not in eviction.evict(evicting(mirror), now=far_future).keys  # (other tests' records go)
    assert live_row(mirror, pub.key) is not None
