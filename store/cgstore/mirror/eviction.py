"""Mirror eviction: a mirror is a cache, so records its workers stopped downloading go, to be pulled again.

A blob download on a mirror notes when the blob was last served
(``blobs.last_served_at``, migration 0021), at most once a minute per blob and
per process: a hot blob read in hundreds of ranged parts costs one write a
minute, not one per part. ``evict`` (run by the GC task, under its lease)
removes the mirrored records — ``compiled_graphs.origin`` set, live — none of
whose blobs (artifact and components) was served since
``now - CGSTORE_MIRROR_EVICT_AFTER`` (a blob never served counts from when it
was stored). The record rows go; their blobs then belong to no record and
the same GC round (or the next, once the grace has passed) deletes them by
the ordinary rules, so a blob another record still names is kept.

Nothing is lost: the upstream still has the record and its receipt, and the
next resolve of the key on this mirror is a miss here that pulls it again
(``mirror.service``). Records this store admitted itself (``origin`` NULL) and
yanked records (left to the ordinary retention, so the yank stays visible)
are never evicted.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from dataclasses import dataclass

from sqlalchemy import and_, delete, exists, func, or_, select, update

from cgstore.blobs.models import Blob
from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphComponent
from cgstore.context import StoreContext
from cgstore.core.db import utcnow

#: A blob's ``last_served_at`` is written at most this often (per process).
TOUCH_EVERY_S = 60.0
#: Records removed per transaction.
BATCH = 200

#: (the store's database, digest) -> when this process last wrote it: several apps may share a process (tests).
_touched: dict[tuple[int, str], float] = {}
_touched_lock = threading.Lock()


def is_mirror(ctx: StoreContext) -> bool:
    """Whether this store mirrors an upstream (``CGSTORE_UPSTREAM_URL`` set)."""
    return bool(getattr(ctx.settings, "upstream_url", None))


def note_served(ctx: StoreContext, digest: str) -> None:
    """A download of ``digest`` is being answered: on a mirror, move its ``last_served_at`` (throttled)."""
    if not is_mirror(ctx):
        return
    now = time.monotonic()
    with _touched_lock:
        seen = (id(ctx.db), digest)
        if now - _touched.get(seen, -TOUCH_EVERY_S) < TOUCH_EVERY_S:
            return
        if len(_touched) > 100_000:  # bounded: forgetting only costs one more (conditional) write
            _touched.clear()
        _touched[seen] = now
    at = utcnow()
    stale = at - dt.timedelta(seconds=TOUCH_EVERY_S)
    with ctx.db.session() as session:
        session.execute(
            update(Blob)
            .where(Blob.digest == digest, or_(Blob.last_served_at.is_(None), Blob.last_served_at < stale))
            .values(last_served_at=at)
        )


def _used_since(cutoff: dt.datetime):
    """True for a blob served (or, never served, stored) at or after ``cutoff``."""
    return func.coalesce(Blob.last_served_at, Blob.created_at) >= cutoff


def _evictable(cutoff: dt.datetime):
    """A live mirrored record none of whose blobs was used since ``cutoff``."""
    artifact_used = exists().where(Blob.digest == CompiledGraph.artifact_digest, _used_since(cutoff))
    component_used = exists().where(
        CompiledGraphComponent.record_id == CompiledGraph.id,
        Blob.digest == CompiledGraphComponent.digest,
        _used_since(cutoff),
    )
    return and_(CompiledGraph.origin.is_not(None), CompiledGraph.yanked_at.is_(None), ~artifact_used, ~component_used)


@dataclass(frozen=True)
class Evicted:
    """What one eviction pass removed: the records (``owner/repo`` is not needed: keys are enough to log)."""

    records: int
    keys: list[str]


def evict(ctx: StoreContext, now: dt.datetime | None = None, heartbeat=None) -> Evicted:
    """Remove the mirrored records unused for ``CGSTORE_MIRROR_EVICT_AFTER``; a no-op off a mirror or when 0."""
    after = ctx.settings.mirror_evict_after
    if not is_mirror(ctx) or not after:
        return Evicted(0, [])
    cutoff = (now or utcnow()) - dt.timedelta(seconds=after)
    keys: list[str] = []
    while True:
        with ctx.db.session() as session:
            rows = session.execute(
                select(CompiledGraph.id, CompiledGraph.key)
                .where(_evictable(cutoff))
                .order_by(CompiledGraph.id)
                .limit(BATCH)
            ).all()
            if not rows:
                break
            # Re-checked in the DELETE itself: a download that touched a blob since the SELECT keeps its record.
            # Components go by the foreign key's ON DELETE CASCADE (PostgreSQL, and SQLite with foreign_keys=ON).
            gone = session.scalars(
                delete(CompiledGraph)
                .where(CompiledGraph.id.in_([row.id for row in rows]), _evictable(cutoff))
                .returning(CompiledGraph.key)
                .execution_options(synchronize_session=False)
            ).all()
            keys.extend(gone)
        if heartbeat is not None:
            heartbeat()
        if len(rows) < BATCH:
            break
    if keys:
        ctx.metrics.mirror_evicted.inc(len(keys))
    return Evicted(len(keys), keys)
