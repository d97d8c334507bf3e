"""Garbage collection: delete blobs nothing keeps, in batches, and reap what uploads left behind.

A blob is kept while any of these holds:
- it was linked within the grace period (``blobs.linked_at``: every repo link,
  session commit and publish writes it in its own transaction);
- a repo link younger than the grace period names it;
- a live record, or one yanked within the grace period, names it as its
  artifact or a component (records yanked longer ago go with their blobs).

A blob nothing keeps goes in three steps, each idempotent, so a run that dies
anywhere is finished by the next one:

1. *condemn* — one conditional UPDATE sets ``collecting_since`` on the batch,
   re-checking every rule on the row itself. It races a publish only through
   that row: a publish writes ``linked_at`` (``blobs.service.hold_blobs``), so
   whichever transaction commits first wins — GC re-reads the fresh
   ``linked_at`` and spares the blob, or the publish finds it condemned and is
   refused. From here on readers treat the blob as absent.
2. *delete the bytes* — absent objects count as deleted.
3. *forget* — the blob's repo links and row are deleted.

After the blobs, GC reaps expired upload sessions and drops staged uploads
no session row names any more, once last written longer ago than the grace.
The periodic round (``collect_garbage``) also trims the record events feed
past its horizon (``compiled_graphs.events.trim``, ``CGSTORE_EVENTS_RETENTION_S``)
and, first, on a mirror, evicts mirrored records unused for
``CGSTORE_MIRROR_EVICT_AFTER`` (``mirror.eviction``), whose blobs this round then collects.

The scan walks blobs by digest with a keyset cursor, saved in the GC lease
after every batch, so a successor on another replica resumes where a dead
holder stopped.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, and_, delete, exists, select, update
from sqlalchemy.orm import Session

from cgstore.blobs import service as blobs_service
from cgstore.blobs.models import Blob, RepoBlob
from cgstore.compiled_graphs import events, retention
from cgstore.context import StoreContext
from cgstore.core.db import utcnow
from cgstore.core.faults import crash_point
from cgstore.mirror import eviction
from cgstore.operations import leases
from cgstore.operations.leases import HeldLease

log = logging.getLogger(__name__)

#: Other features' reasons to keep a blob: ``keeper(cutoff)`` is a SQL condition
#: over ``Blob`` that is true while that feature still needs the blob.
Keeper = Callable[[dt.datetime], ColumnElement[bool]]


def _young_repo_link(cutoff: dt.datetime) -> ColumnElement[bool]:
    return exists().where(RepoBlob.digest == Blob.digest, RepoBlob.created_at >= cutoff)


KEEPERS: list[Keeper] = [_young_repo_link, retention.blob_kept_by_records]


@dataclass
class GcReport:
    """What a run did (or, dry, would do)."""

    dry_run: bool
    #: The condemned digests, in the order they went (dry: would go).
    blobs: list[str] = field(default_factory=list)
    bytes: int = 0
    #: Blobs per batch, in order.
    batches: list[int] = field(default_factory=list)
    #: Expired upload sessions (dry: their ids) and orphaned writes reclaimed.
    sessions: list[str] = field(default_factory=list)
    sessions_reaped: int = 0
    #: Staged uploads no session row names, older than the grace: dropped (dry: would be).
    staged: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "dry_run": self.dry_run,
            "blobs": len(self.blobs),
            "bytes": self.bytes,
            "batches": len(self.batches),
            "sessions": self.sessions_reaped if not self.dry_run else len(self.sessions),
            "staged": len(self.staged),
        }


def _collectable(cutoff: dt.datetime) -> ColumnElement[bool]:
    """True for a blob nothing keeps (evaluated on the blob's own row and its references)."""
    kept = [keeper(cutoff) for keeper in KEEPERS]
    return and_(Blob.collecting_since.is_(None), Blob.linked_at < cutoff, *[~condition for condition in kept])


def find_candidates(ctx: StoreContext, cutoff: dt.datetime, after: str, limit: int) -> list[tuple[str, int]]:
    """The next ``limit`` collectable blobs after digest ``after``: (digest, size), by digest."""
    with ctx.db.session() as session:
        rows = session.execute(
            select(Blob.digest, Blob.size)
            .where(Blob.digest > after, _collectable(cutoff))
            .order_by(Blob.digest)
            .limit(limit)
        )
        return [(digest, size) for digest, size in rows]


def condemn(ctx: StoreContext, digests: list[str], cutoff: dt.datetime, now: dt.datetime) -> list[str]:
    """Mark those of ``digests`` that are still collectable; return them. Step 1 above."""
    if not digests:
        return []
    with ctx.db.session() as session:
        return condemn_in(session, digests, cutoff, now)


def condemn_in(session: Session, digests: list[str], cutoff: dt.datetime, now: dt.datetime) -> list[str]:
    """``condemn`` inside the caller's transaction (tests hold it open to interleave a publish)."""
    condemned = session.scalars(
        update(Blob)
        .where(Blob.digest.in_(digests), _collectable(cutoff))
        .values(collecting_since=now)
        .returning(Blob.digest)
        .execution_options(synchronize_session=False)
    )
    return sorted(condemned)


def reclaim(ctx: StoreContext, digests: list[str]) -> None:
    """Delete condemned blobs' bytes, then their links and rows. Steps 2 and 3 above."""
    if not digests:
        return
    ctx.storage.delete_many(digests)
    with ctx.db.session() as session:
        retention.forget_yanked_records(session, digests)
        session.execute(delete(RepoBlob).where(RepoBlob.digest.in_(digests)))
        session.execute(
            delete(Blob)
            .where(Blob.digest.in_(digests), Blob.collecting_since.is_not(None))
            .execution_options(synchronize_session=False)
        )


def _condemned_after(ctx: StoreContext, after: str, limit: int) -> list[tuple[str, int]]:
    """Blobs an earlier run condemned but did not finish (it died between steps), by digest."""
    with ctx.db.session() as session:
        rows = session.execute(
            select(Blob.digest, Blob.size)
            .where(Blob.digest > after, Blob.collecting_since.is_not(None))
            .order_by(Blob.digest)
            .limit(limit)
        )
        return [(digest, size) for digest, size in rows]


def collect(
    ctx: StoreContext,
    *,
    dry_run: bool = False,
    lease: HeldLease | None = None,
    now: dt.datetime | None = None,
    grace_s: int | None = None,
    batch_size: int | None = None,
) -> GcReport:
    """One garbage collection over the whole registry (under ``lease`` when given)."""
    now = now or utcnow()
    grace_s = ctx.settings.gc_grace_s if grace_s is None else grace_s
    batch_size = batch_size or ctx.settings.gc_batch_size
    cutoff = now - dt.timedelta(seconds=grace_s)
    report = GcReport(dry_run=dry_run)

    def note_batch(batch: list[tuple[str, int]]) -> None:
        report.blobs.extend(digest for digest, _ in batch)
        report.bytes += sum(size for _, size in batch)
        report.batches.append(len(batch))

    # Finish what a dead run condemned; then the scan from the saved cursor (or the start).
    after = ""
    while unfinished := _condemned_after(ctx, after, batch_size):
        after = unfinished[-1][0]
        if not dry_run:
            reclaim(ctx, [digest for digest, _ in unfinished])
            if lease is not None:
                lease.renew()
        note_batch(unfinished)
    # A dry run starts where the next real run will: the cursor a dead holder saved.
    saved = lease.cursor if lease is not None else leases.saved_cursor(ctx.db, leases.GC) if dry_run else None
    cursor = saved or ""
    while batch := find_candidates(ctx, cutoff, cursor, batch_size):
        cursor = batch[-1][0]
        if dry_run:
            note_batch(batch)
            continue
        sizes = dict(batch)
        condemned = condemn(ctx, list(sizes), cutoff, now)
        crash_point("gc.condemned")
        reclaim(ctx, condemned)
        note_batch([(digest, sizes[digest]) for digest in condemned])
        if lease is not None:
            lease.save_cursor(cursor)
    if lease is not None and not dry_run:
        lease.save_cursor(None)  # a full pass: the next run starts from the beginning
    _collect_sessions(ctx, report, now, grace_s, lease)
    _sweep_staging(ctx, report, cutoff, batch_size, lease)
    return report


def _collect_sessions(
    ctx: StoreContext, report: GcReport, now: dt.datetime, grace_s: int, lease: HeldLease | None
) -> None:
    """Expired upload sessions (S3: their multipart uploads), and writes orphaned longer than the grace."""
    if report.dry_run:
        report.sessions = blobs_service.expired_session_ids(ctx, now)
        return
    report.sessions_reaped = blobs_service.reap_expired_sessions(
        ctx, now, heartbeat=_heartbeat(lease), orphan_age_s=grace_s
    )


def _sweep_staging(
    ctx: StoreContext, report: GcReport, cutoff: dt.datetime, batch_size: int, lease: HeldLease | None
) -> None:
    """Staged uploads whose session row is gone, last written before the grace cutoff."""
    report.staged = blobs_service.sessionless_staging(ctx, cutoff, batch_size)
    if not report.dry_run:
        blobs_service.drop_staging(ctx, report.staged, heartbeat=_heartbeat(lease))


def _heartbeat(lease: HeldLease | None) -> Callable[[], None]:
    """What runs between units of work: the lease's renew, when the run holds one."""
    return lease.renew if lease is not None else (lambda: None)


def collect_garbage(ctx: StoreContext, lease: HeldLease) -> int:
    """The periodic GC round (``operations.service.run_periodically``): returns blobs deleted."""
    # A mirror's unused records go first, so their blobs go in this same round (past the grace).
    evicted = eviction.evict(ctx, heartbeat=lease.renew)
    if evicted.records:
        log.info("gc: evicted %d mirrored records unused for %d s", evicted.records, ctx.settings.mirror_evict_after)
    report = collect(ctx, lease=lease)
    # The events feed's retention rides the same round (one replica at a time, under the GC lease).
    trimmed = events.trim(ctx)
    if trimmed:
        log.info("gc: trimmed %d record events older than %d s", trimmed, ctx.settings.events_retention_s)
    ctx.metrics.gc_blobs_deleted.inc(len(report.blobs))
    ctx.metrics.gc_bytes_deleted.inc(report.bytes)
    if report.blobs or report.sessions_reaped or report.staged:
        log.info("gc: %s", report.summary())
    return len(report.blobs)
