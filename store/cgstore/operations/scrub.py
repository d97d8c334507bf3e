"""Scrub: re-hash stored blobs through the storage interface and take damaged ones out of service.

Each blob of the scope (every blob, or those linked into one repo) is read back
through ``ctx.storage`` — the same interface for both backends, streamed in
``READ_CHUNK_BYTES`` chunks, never whole in memory — and hashed with blake3.
Absent bytes make it ``missing``; a size or digest that differs from the row,
``corrupt``. A changed state is written with ``health.set_blob_health`` in one
transaction with its audit entry, so resolve stops (or resumes) returning every
record that binds the blob.

A full pass walks blobs in digest order and saves its cursor with each verdict
(``scrub_cursors``, per scope), so an interrupted pass continues with
``resume=True`` where it stopped; a pass that reaches the end clears it. A
sample checks ``sample`` blobs picked at random and leaves the cursor alone.
Reads are paced by a token bucket on bytes (``rate_bytes_s``), so a scrub
shares the disk or bucket with serving traffic.

With ``CGSTORE_SCRUB_INTERVAL_S`` set, each server round (under the ``scrub``
lease) checks the next ``BATCH`` blobs of the pass over every blob, so a round
is bounded and successive rounds cover the registry.

Infrastructure failures (``Unavailable``) stop the scrub and propagate: an
outage is not evidence against the bytes, and the saved cursor lets the next
run carry on.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import blake3
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from cgstore.blobs.models import BLOB_CORRUPT, BLOB_MISSING, BLOB_OK, Blob, RepoBlob
from cgstore.context import StoreContext
from cgstore.core.db import utcnow
from cgstore.core.errors import BlobUnknown, NameUnknown
from cgstore.core.names import validate_owner, validate_repo
from cgstore.operations.blob_health import set_blob_health
from cgstore.operations.leases import HeldLease
from cgstore.operations.models import ScrubCursor
from cgstore.operations.ratelimit import TokenBucket
from cgstore.repos.service import find_repo
from cgstore.storage.hashing import DIGEST_PREFIX

log = logging.getLogger(__name__)

#: The scope of a scrub over every blob.
SCOPE_ALL = "*"
#: Blobs read from the database per query of a pass.
BATCH = 100
#: Who the audit log names for scrub findings.
ACTOR = "scrub"


@dataclass(frozen=True)
class Finding:
    """A blob whose state this scrub changed (``health``), and how many records followed it."""

    digest: str
    health: str
    records_changed: int


@dataclass
class ScrubReport:
    """What one scrub run did."""

    scope: str
    checked: int = 0
    bytes_read: int = 0
    #: Every blob found missing or corrupt (newly or again).
    damaged: list[Finding] = field(default_factory=list)
    #: Blobs that had been damaged and are intact again.
    healed: list[Finding] = field(default_factory=list)
    #: A full pass that reached the end of its scope (a sample never does).
    complete: bool = False


def scrub(
    ctx: StoreContext,
    *,
    repo: str | None = None,
    sample: int | None = None,
    rate_bytes_s: float | None = None,
    resume: bool = False,
    limit: int | None = None,
    heartbeat: Callable[[], None] = lambda: None,
) -> ScrubReport:
    """Check the blobs of ``repo`` (``owner/name``; None: all). ``heartbeat`` runs between blobs
    (a lease's renew: raising there stops the scrub, the cursor already saved). A walk stops
    after ``limit`` blobs, its cursor saved for the next one to ``resume`` from."""
    with ctx.db.session() as session:
        repo_id = _repo_id(session, repo)
    report = ScrubReport(scope=repo or SCOPE_ALL)
    # One second's worth of burst: the rate holds over any stretch longer than a second.
    bucket = TokenBucket(rate_bytes_s, rate_bytes_s) if rate_bytes_s else None
    walking = sample is None
    batches = _walk(ctx, report.scope, repo_id, resume) if walking else _sampled(ctx, repo_id, sample)
    for digest, size in itertools.islice((blob for batch in batches for blob in batch), limit):
        heartbeat()
        _check(ctx, digest, size, bucket, report, walking)
    if walking and (limit is None or report.checked < limit):
        # The pass reached the end: the next one starts afresh.
        with ctx.db.session() as session:
            _save_cursor(session, report.scope, None)
        report.complete = True
    return report


def scrub_round(ctx: StoreContext, lease: HeldLease) -> int:
    """The periodic scrub round (``operations.service.run_periodically``, every
    ``CGSTORE_SCRUB_INTERVAL_S``): the next ``BATCH`` blobs of the pass over every
    blob, continued from its cursor. Returns how many it found damaged."""
    return len(scrub(ctx, resume=True, limit=BATCH, heartbeat=lease.renew).damaged)


def saved_cursor(ctx: StoreContext, repo: str | None = None) -> str | None:
    """Where ``scrub(repo=..., resume=True)`` would start (None: from the beginning)."""
    with ctx.db.session() as session:
        row = session.get(ScrubCursor, repo or SCOPE_ALL)
        return row.cursor if row else None


def _repo_id(session: Session, repo: str | None) -> int | None:
    if repo is None:
        return None
    owner, _, name = repo.partition("/")
    found = find_repo(session, validate_owner(owner), validate_repo(name))
    if found is None:
        raise NameUnknown("no such repo", repo=repo)
    return found.id


def _scope_query(repo_id: int | None):
    # A blob garbage collection condemned may be gone by design: not damage.
    query = select(Blob.digest, Blob.size).where(Blob.collecting_since.is_(None))
    if repo_id is not None:
        query = query.join(RepoBlob, RepoBlob.digest == Blob.digest).where(RepoBlob.repo_id == repo_id)
    return query


def _walk(ctx: StoreContext, scope: str, repo_id: int | None, resume: bool) -> Iterator[list]:
    """Batches in digest order from the saved cursor (or the start)."""
    cursor = saved_cursor(ctx, None if scope == SCOPE_ALL else scope) if resume else None
    while True:
        query = _scope_query(repo_id).order_by(Blob.digest).limit(BATCH)
        if cursor is not None:
            query = query.where(Blob.digest > cursor)
        with ctx.db.session() as session:
            batch = [tuple(row) for row in session.execute(query)]
        if not batch:
            return
        yield batch
        cursor = batch[-1][0]


def _sampled(ctx: StoreContext, repo_id: int | None, sample: int) -> Iterator[list]:
    with ctx.db.session() as session:
        yield [tuple(row) for row in session.execute(_scope_query(repo_id).order_by(func.random()).limit(sample))]


def _save_cursor(session: Session, scope: str, cursor: str | None) -> None:
    row = session.get(ScrubCursor, scope)
    if row is None:
        session.add(ScrubCursor(scope=scope, cursor=cursor, updated_at=utcnow()))
    else:
        row.cursor, row.updated_at = cursor, utcnow()


def _check(
    ctx: StoreContext, digest: str, size: int, bucket: TokenBucket | None, report: ScrubReport, walking: bool
) -> None:
    """Check one blob; its verdict, audit entry and (when walking) the cursor commit together."""
    health, read = _stored_health(ctx, digest, size, bucket)
    report.checked += 1
    report.bytes_read += read
    with ctx.db.session() as session:
        changed = set_blob_health(session, digest, health, actor=ACTOR, detail={"scope": report.scope})
        if walking:
            _save_cursor(session, report.scope, digest)
    if health != BLOB_OK:
        log.warning("scrub: %s is %s", digest, health)
        report.damaged.append(Finding(digest, health, changed or 0))
    elif changed is not None:
        report.healed.append(Finding(digest, health, changed))


def _stored_health(ctx: StoreContext, digest: str, size: int, bucket: TokenBucket | None) -> tuple[str, int]:
    """(health, bytes read): ``missing`` when absent, ``corrupt`` when size or digest differ."""
    stored = ctx.storage.size(digest)
    if stored is None:
        return BLOB_MISSING, 0
    if stored != size:
        return BLOB_CORRUPT, 0
    hasher = blake3.blake3()
    read = 0
    try:
        for chunk in ctx.storage.read(digest, 0, size):
            if bucket is not None:
                bucket.take(len(chunk))
            hasher.update(chunk)
            read += len(chunk)
    except BlobUnknown:  # deleted between the stat and the read
        return BLOB_MISSING, read
    if read != size or DIGEST_PREFIX + hasher.hexdigest() != digest:
        return BLOB_CORRUPT, read
    return BLOB_OK, read
