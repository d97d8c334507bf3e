"""The blobs capability: verified uploads (monolithic and resumable), links, mounts, reads.

Bytes are stored once globally by digest (``storage``) and linked per repo
(``repo_blobs``). A link is written only after the storage backend verified
the digest and size of the whole stream; a failure at any point leaves no
link and no visible bytes. Database transactions stay short: none is held open
while bytes stream.

Services that take a request body are generators (``core.http.BodyConsumer``):
primed, their checks run before any byte is read; then they are sent each
batch of the body, and ``None`` at its end. The HTTP layer runs each step in a
worker thread and awaits the body on the event loop in between, so no thread
waits on a slow client; a consumer closed mid-body aborts its write.

Knowing a digest grants nothing: a repo gets a link only by sending the bytes
(which are hashed even when the blob is already stored) or by mounting from a
repo the caller can read. Every principal that links a blob into a repo is
recorded as one of its holders (``repo_blob_holders``); in a private cache
(``access.private_reader``) a blob exists, for reads, ``blobs:missing`` and the
blobs a publish names, only for its holders.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from cgstore import access
from cgstore.audit.service import record
from cgstore.blobs.models import BLOB_OK, Blob, RepoBlob, RepoBlobHolder, UploadSession
from cgstore.context import StoreContext
from cgstore.core.db import insert_ignoring_conflicts, utcnow
from cgstore.core.errors import (
    BlobUnknown,
    BlobUploadUnknown,
    DigestInvalid,
    RangeInvalid,
    SizeInvalid,
    StoreError,
    TooLarge,
    Unavailable,
    maybe_hidden_miss,
)
from cgstore.core.faults import crash_point
from cgstore.core.http import BodyConsumer
from cgstore.core.names import split_repo_path
from cgstore.operations.blob_health import set_blob_health
from cgstore.repos.models import Repo
from cgstore.repos.service import ensure_repo, readable_repo, writable_repo
from cgstore.storage import StagedUpload
from cgstore.tokens.claims import Claims
from cgstore_client.keys import is_digest

MAX_MISSING_QUERY = 1024
# What ``open_session`` hands out (a uuid4 as 32 lowercase hex). Anything else
# cannot name a session, so it is refused before it reaches a query: bytes such
# as NUL, which PostgreSQL refuses in text, must never get that far.
SESSION_ID_RE = re.compile(r"[0-9a-f]{32}", re.ASCII)  # used with fullmatch


def validate_digest(digest: str) -> str:
    if not is_digest(digest):
        raise DigestInvalid("digests are 'blake3:' + 64 lowercase hex", digest=digest[:100])
    return digest


# -- reads ----------------------------------------------------------------------


@dataclass(frozen=True)
class BlobLocation:
    digest: str
    size: int


def locate(ctx: StoreContext, claims: Claims, owner: str, repo: str, digest: str) -> BlobLocation:
    """The blob linked in ``owner/repo``, if the caller may read it; else ``BLOB_UNKNOWN``."""
    validate_digest(digest)
    with ctx.db.session() as session:
        found = readable_repo(session, claims, owner, repo, BlobUnknown, "blob unknown to this repo", digest=digest)
        size = _visible_size(session, claims, found, digest)
    if size is None:
        raise _blob_miss(claims, found, digest)
    return BlobLocation(digest, size.size)


def _blob_miss(claims: Claims, target: Repo, digest: str) -> StoreError:
    """The miss of ``digest`` in ``target``; in a private cache, audited as a denial if another principal holds it."""
    reader = access.private_reader(claims, target.visibility)
    if reader is None:
        return BlobUnknown("blob unknown to this repo", digest=digest)

    repo_id = target.id  # read now: the probe runs after this session has closed

    def held_by_another(session: Session, at: dt.datetime) -> bool:
        return (
            session.scalar(
                select(RepoBlobHolder.principal)
                .where(
                    RepoBlobHolder.repo_id == repo_id,
                    RepoBlobHolder.digest == digest,
                    RepoBlobHolder.principal != reader,
                    RepoBlobHolder.created_at <= at,
                )
                .limit(1)
            )
            is not None
        )

    return maybe_hidden_miss(BlobUnknown, "blob unknown to this repo", held_by_another, digest=digest)


def _visible_size(session: Session, claims: Claims, target: Repo, digest: str):
    """The ``(digest, size)`` row of ``digest`` in ``target`` if ``claims`` may see it, else None.

    In a private cache the reader's own holder row is looked up first, on its
    own: another principal's blob and an absent one then both end at that one
    index probe, where a join would go on to load the other holder's rows and
    answer measurably later (the timing leak of issue 15 §3; ``_blob_miss``
    leaves telling them apart to the audit's flush).
    """
    reader = access.private_reader(claims, target.visibility)
    if reader is not None:
        mine = select(RepoBlobHolder.digest).where(
            RepoBlobHolder.repo_id == target.id, RepoBlobHolder.digest == digest, RepoBlobHolder.principal == reader
        )
        if session.scalar(mine) is None:
            return None
    return session.execute(_linked_blobs(target, [digest])).first()


def _linked_blobs(target: Repo, digests: list[str]):
    """``SELECT digest, size`` of those ``digests`` linked in ``target`` (a blob being collected is gone)."""
    return (
        select(Blob.digest, Blob.size)
        .join(RepoBlob, RepoBlob.digest == Blob.digest)
        .where(RepoBlob.repo_id == target.id, Blob.digest.in_(digests), Blob.collecting_since.is_(None))
    )


def visible_blobs(claims: Claims, target: Repo, digests: list[str]):
    """``_linked_blobs`` that ``claims`` may see there: in a private cache, only the ones it holds."""
    query = _linked_blobs(target, digests)
    reader = access.private_reader(claims, target.visibility)
    if reader is None:
        return query
    return query.join(
        RepoBlobHolder,
        (RepoBlobHolder.repo_id == RepoBlob.repo_id) & (RepoBlobHolder.digest == RepoBlob.digest),
    ).where(RepoBlobHolder.principal == reader)


def held_blobs(claims: Claims, target: Repo, digests: list[str]):
    """``visible_blobs`` that are intact: a blob the scrub found damaged counts as absent until sent again."""
    return visible_blobs(claims, target, digests).where(Blob.health == BLOB_OK)


def download_url(ctx: StoreContext, location: BlobLocation) -> str | None:
    """A presigned storage URL to redirect to, when the backend and settings allow it."""
    if not (ctx.settings.redirect_downloads and ctx.storage.supports_presign):
        return None
    return ctx.storage.presigned_url(location.digest, ctx.settings.presign_ttl_s)


def read(ctx: StoreContext, location: BlobLocation, start: int, end: int) -> Iterator[bytes]:
    return ctx.storage.read(location.digest, start, end)


def missing(ctx: StoreContext, claims: Claims, owner: str, repo: str, digests: list[str]) -> list[str]:
    """Which of ``digests`` are not linked in this repo, or were found damaged (needs write: it is a
    pre-upload check, and a damaged blob must be sent again)."""
    if len(digests) > MAX_MISSING_QUERY:
        raise TooLarge(f"at most {MAX_MISSING_QUERY} digests per query", limit=MAX_MISSING_QUERY)
    for digest in digests:
        validate_digest(digest)
    with ctx.db.session() as session:
        target = writable_repo(session, claims, owner, repo)
        linked = (
            set()
            if target is None
            else {row.digest for row in session.execute(held_blobs(claims, target, list(set(digests))))}
        )
    return [d for d in dict.fromkeys(digests) if d not in linked]


# -- monolithic upload ----------------------------------------------------------------


def upload(
    ctx: StoreContext,
    claims: Claims,
    owner: str,
    repo: str,
    digest: str,
    declared_size: int | None,
) -> BodyConsumer[int]:
    """Monolithic PUT: stream the body into storage verified, then link. Returns the size."""
    validate_digest(digest)
    with ctx.db.session() as session:
        writable_repo(session, claims, owner, repo)
        stored = _stored(session, digest)
        # A blob the scrub found damaged is written again for real: that is how it heals.
        already_stored = stored is not None and stored.health == BLOB_OK
    # The writer checks the store's limit (at once for a declared size), the size
    # (as soon as too many bytes arrive) and the digest.
    if already_stored:
        writer = ctx.storage.verify_only(digest, declared_size)
    else:
        writer = ctx.storage.writer(digest, declared_size)
    with writer:
        while (chunk := (yield)) is not None:
            writer.write(chunk)
        size = writer.commit()
    crash_point("upload.stored")
    _link(ctx, claims, owner, repo, digest, size, action="blob.upload", wrote=not already_stored)
    return size


def _stored(session: Session, digest: str) -> Blob | None:
    """The blob's row when its bytes are stored and not condemned; 503 while GC is deleting them."""
    found = session.get(Blob, digest)
    if found is not None and found.collecting_since is not None:
        raise _being_collected(digest)
    return found


def _being_collected(digest: str) -> Unavailable:
    return Unavailable("the blob is being garbage-collected: send it again shortly", digest=digest)


def hold_blobs(session: Session, digests: Iterable[str]) -> set[str]:
    """Mark ``digests`` linked now, in the caller's transaction; return those not stored.

    This is the publish side of the race with garbage collection: the UPDATE
    writes (and on PostgreSQL locks) each blob row, and GC condemns a row only
    by a conditional UPDATE that re-reads ``linked_at``/``collecting_since`` of
    that same row. Whichever commits first wins: either GC sees the fresh
    ``linked_at`` and spares the blob, or the blob is already condemned and
    the publish gets it back among the missing.
    """
    wanted = set(digests)
    if not wanted:
        return set()
    session.execute(
        update(Blob)
        .where(Blob.digest.in_(wanted), Blob.collecting_since.is_(None))
        .values(linked_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    held = set(session.scalars(select(Blob.digest).where(Blob.digest.in_(wanted), Blob.collecting_since.is_(None))))
    return wanted - held


def _hold_or_store(session: Session, digest: str, size: int) -> None:
    """Record verified bytes as stored, or mark the stored blob linked now (see ``hold_blobs``)."""
    now = utcnow()
    if insert_ignoring_conflicts(session, Blob, digest=digest, size=size, created_at=now, linked_at=now):
        return
    if hold_blobs(session, [digest]):
        # Condemned since our check: GC may delete the very bytes just written.
        raise _being_collected(digest)


def _link(
    ctx: StoreContext,
    claims: Claims,
    owner: str,
    repo: str,
    digest: str,
    size: int,
    action: str,
    *,
    wrote: bool,
    **detail,
) -> None:
    """Record a verified write: the blob, its link, the repo if this is its first write, the audit.

    ``wrote``: the bytes were just stored (not only verified against stored ones), which heals a
    blob the scrub found damaged, and the records binding it.
    """
    with ctx.db.session() as session:
        target = ensure_repo(session, claims, owner, repo)
        _hold_or_store(session, digest, size)
        if wrote:
            set_blob_health(session, digest, BLOB_OK, actor=claims.sub, jti=claims.jti, detail={"via": action})
        linked = insert_ignoring_conflicts(
            session, RepoBlob, repo_id=target.id, digest=digest, linked_by=claims.sub, created_at=utcnow()
        )
        insert_ignoring_conflicts(
            session, RepoBlobHolder, repo_id=target.id, digest=digest, principal=claims.sub, created_at=utcnow()
        )
        record(
            session,
            actor=claims.sub,
            jti=claims.jti,
            action=action,
            target=f"{target.owner}/{target.name}@{digest}",
            repo=f"{target.owner}/{target.name}",
            detail={"size": size, "new_link": linked, **detail},
        )


# -- mount --------------------------------------------------------------------------


def mount(ctx: StoreContext, claims: Claims, owner: str, repo: str, digest: str, source: str) -> int:
    """Link a blob the caller can read in ``source`` into ``owner/repo`` without re-upload."""
    validate_digest(digest)
    source_owner, source_repo = split_repo_path(source)
    with ctx.db.session() as session:
        writable_repo(session, claims, owner, repo)
    location = locate(ctx, claims, source_owner, source_repo, digest)
    _link(ctx, claims, owner, repo, digest, location.size, action="blob.mount", wrote=False, source=source)
    return location.size


# -- resumable upload sessions -------------------------------------------------------


def _expiry(ctx: StoreContext) -> dt.datetime:
    return utcnow() + dt.timedelta(seconds=ctx.settings.upload_session_ttl_s)


def open_session(ctx: StoreContext, claims: Claims, owner: str, repo: str) -> str:
    """Open a resumable upload. It is the start of a write into the repo, whose row
    the session references, so a repo with no blob yet comes into being here, in
    the transaction that records the session, once its staging exists."""
    with ctx.db.session() as session:
        writable_repo(session, claims, owner, repo)
    session_id = uuid.uuid4().hex  # of the SESSION_ID_RE grammar
    staged = ctx.storage.stage_begin(session_id)
    try:
        with ctx.db.session() as session:
            target = ensure_repo(session, claims, owner, repo)
            session.add(
                UploadSession(
                    id=session_id,
                    repo_id=target.id,
                    principal=claims.sub,
                    offset=0,
                    storage_state=staged.state,
                    created_at=utcnow(),
                    expires_at=_expiry(ctx),
                )
            )
    except BaseException:
        # No row will ever name this staging. The original failure is the answer,
        # even if storage cannot drop it now.
        with contextlib.suppress(Unavailable):
            ctx.storage.stage_abort(staged)
        raise
    return session_id


def _find_session(ctx: StoreContext, claims: Claims, owner: str, repo: str, session_id: str) -> UploadSession:
    """The caller's own live session in this repo; anything else is ``BLOB_UPLOAD_UNKNOWN``.

    An id outside the session-id grammar answers exactly like an unknown one.
    """
    with ctx.db.session() as session:
        target = writable_repo(session, claims, owner, repo)
        well_formed = SESSION_ID_RE.fullmatch(session_id) is not None
        found = session.get(UploadSession, session_id) if well_formed else None
    if (
        found is None
        or target is None
        or found.repo_id != target.id
        or found.principal != claims.sub
        or found.expires_at <= utcnow()
    ):
        # ascii(): a refused id is echoed escaped (no NUL, no raw non-ASCII) and bounded.
        raise BlobUploadUnknown("no such upload session", session=ascii(session_id)[1:-1][:64])
    return found


def session_offset(ctx: StoreContext, claims: Claims, owner: str, repo: str, session_id: str) -> int:
    return _find_session(ctx, claims, owner, repo, session_id).offset


def append(
    ctx: StoreContext,
    claims: Claims,
    owner: str,
    repo: str,
    session_id: str,
    content_range: tuple[int, int] | None,
) -> BodyConsumer[int]:
    """Stage one chunk (the body); it must start at the committed offset. Returns the new offset.

    A refused chunk leaves the staged bytes exactly at the committed offset: its
    length is checked before the append finishes (refusing it aborts the
    append, which cuts back what it wrote), and a chunk that loses the offset's
    compare-and-set is discarded.
    """
    found = _find_session(ctx, claims, owner, repo, session_id)
    if content_range is not None and content_range[0] != found.offset:
        raise RangeInvalid("chunk does not start at the committed offset", offset=found.offset)
    expected = None if content_range is None else content_range[1] - content_range[0]
    received = 0
    before = StagedUpload(found.id, found.offset, found.storage_state)
    # The store's size limit is storage's to apply: its stage writer refuses a
    # declared length past it at once (before the body is read), bytes as they come.
    with ctx.storage.stage_writer(before, expected) as writer:
        while (chunk := (yield)) is not None:
            received += len(chunk)
            if expected is not None and received > expected:
                raise SizeInvalid("chunk longer than its Content-Range", expected=expected)
            writer.write(chunk)
        if expected is not None and received != expected:
            # Raised inside the writer, so that it aborts: its bytes are cut back.
            raise SizeInvalid("chunk shorter than its Content-Range", expected=expected, received=received)
        staged = writer.finish()
    crash_point("session.staged")
    with ctx.db.session() as session:
        # Compare-and-set on the offset: of two racing chunks at one offset, one wins.
        moved = session.execute(
            update(UploadSession)
            .where(UploadSession.id == found.id, UploadSession.offset == found.offset)
            .values(offset=staged.offset, storage_state=staged.state, expires_at=_expiry(ctx))
        ).rowcount
    if not moved:
        # Only on a definite loss: after an error the update may have landed.
        ctx.storage.stage_discard(before, staged)
        raise RangeInvalid("another chunk was committed at this offset", offset=found.offset)
    with contextlib.suppress(Unavailable):  # the chunk is recorded; leftovers go with the session
        ctx.storage.stage_recorded(before, staged)
    return staged.offset


def commit_session(
    ctx: StoreContext,
    claims: Claims,
    owner: str,
    repo: str,
    session_id: str,
    digest: str,
) -> BodyConsumer[int]:
    """Append an optional last chunk (the body), verify the whole stream, link the blob. Returns the size."""
    validate_digest(digest)
    first = yield
    if first is not None:
        yield from _append_from(first, append(ctx, claims, owner, repo, session_id, None))
    found = _find_session(ctx, claims, owner, repo, session_id)
    with ctx.db.session() as session:
        # 503 while GC deletes these bytes, before the commit consumes the session: the client retries it.
        _stored(session, digest)
    staged = StagedUpload(found.id, found.offset, found.storage_state)
    try:
        size = ctx.storage.stage_commit(staged, digest)
    except DigestInvalid:
        # The storage dropped the staged bytes: a mismatch leaves nothing to resume.
        _forget_session(ctx, found.id)
        raise
    crash_point("commit.stored")
    _forget_session(ctx, found.id)
    _link(ctx, claims, owner, repo, digest, size, action="blob.upload", wrote=True, session=found.id)
    return size


def _append_from(first: bytes, appending: BodyConsumer[int]) -> Generator[None, bytes | None, None]:
    """Feed ``appending`` the batch already received, then the rest of the body."""
    next(appending)
    chunk: bytes | None = first
    try:
        while chunk is not None:
            appending.send(chunk)
            chunk = yield
        appending.send(None)
    except StopIteration:
        return
    finally:
        appending.close()  # closed mid-body: its write aborts
    raise RuntimeError("append asked for bytes after the body ended")


def cancel_session(ctx: StoreContext, claims: Claims, owner: str, repo: str, session_id: str) -> None:
    found = _find_session(ctx, claims, owner, repo, session_id)
    ctx.storage.stage_abort(StagedUpload(found.id, found.offset, found.storage_state))
    _forget_session(ctx, found.id)


def _forget_session(ctx: StoreContext, session_id: str) -> None:
    with ctx.db.session() as session:
        session.execute(delete(UploadSession).where(UploadSession.id == session_id))


def expired_session_ids(ctx: StoreContext, now: dt.datetime | None = None, limit: int = 1000) -> list[str]:
    """Sessions past their expiry, oldest expiry first (what the reaper takes next)."""
    with ctx.db.session() as session:
        return list(
            session.scalars(
                select(UploadSession.id)
                .where(UploadSession.expires_at <= (now or utcnow()))
                .order_by(UploadSession.expires_at)
                .limit(limit)
            )
        )


def reap_expired_sessions(
    ctx: StoreContext,
    now: dt.datetime | None = None,
    heartbeat: Callable[[], None] = lambda: None,
    orphan_age_s: float | None = None,
) -> int:
    """Reclaim expired sessions' staged bytes and orphaned writes; returns how many were reaped.

    ``heartbeat`` runs between sessions: the periodic task renews its lease there.
    Orphaned writes count as such after ``orphan_age_s`` (default: the session TTL).
    """
    now = now or utcnow()
    with ctx.db.session() as session:
        expired = list(session.scalars(select(UploadSession).where(UploadSession.expires_at <= now).limit(1000)))
    for found in expired:
        heartbeat()
        ctx.storage.stage_abort(StagedUpload(found.id, found.offset, found.storage_state))
        _forget_session(ctx, found.id)
    # Writes of a process that died mid-upload have no session row; a write idle
    # for as long as a session may be is abandoned too.
    age_s = ctx.settings.upload_session_ttl_s if orphan_age_s is None else orphan_age_s
    orphans = ctx.storage.sweep_orphans(older_than_s=age_s)
    return len(expired) + orphans


def sessionless_staging(ctx: StoreContext, written_before: dt.datetime, batch_size: int) -> list[str]:
    """Staged uploads last written before ``written_before`` that no session row names.

    How they come about: an append that finished after its session was cancelled
    or reaped, an abort that failed (storage unreachable) after the row was gone,
    a process that died between staging and recording a session. Whoever wrote
    them is long gone once they are older than the cutoff (the GC grace): a
    session's staging is written before its row, never after it is deleted.
    """
    staged = ctx.storage.staged_sessions(written_before)
    orphaned = []
    for start in range(0, len(staged), batch_size):
        batch = staged[start : start + batch_size]
        with ctx.db.session() as session:
            recorded = set(session.scalars(select(UploadSession.id).where(UploadSession.id.in_(batch))))
        orphaned += [session_id for session_id in batch if session_id not in recorded]
    return orphaned


def drop_staging(ctx: StoreContext, session_ids: list[str], heartbeat: Callable[[], None] = lambda: None) -> None:
    """Delete the staged bytes of ``session_ids`` (``sessionless_staging``); ``heartbeat`` runs between them."""
    for session_id in session_ids:
        heartbeat()
        ctx.storage.stage_abort(StagedUpload(session_id))


def open_session_count(ctx: StoreContext) -> int:
    with ctx.db.session() as session:
        return session.scalar(
            select(func.count()).select_from(UploadSession).where(UploadSession.expires_at > utcnow())
        )


@dataclass(frozen=True)
class DayGrowth:
    """Blobs first stored on one UTC day, and their bytes."""

    day: dt.date
    blobs: int
    bytes: int


def growth_per_day(session: Session, since: dt.datetime) -> list[DayGrowth]:
    """Blobs and bytes stored per UTC day since ``since``, oldest day first (grouped by the database)."""
    if session.get_bind().dialect.name == "postgresql":
        day = func.date(func.timezone("UTC", Blob.created_at))
    else:  # SQLite keeps UTC text; date() cuts it to the day
        day = func.date(Blob.created_at)
    rows = session.execute(
        select(day, func.count(), func.coalesce(func.sum(Blob.size), 0))
        .where(Blob.created_at >= since)
        .group_by(day)
        .order_by(day)
    )
    return [DayGrowth(_as_date(when), int(n), int(size)) for when, n, size in rows]


def _as_date(value: dt.date | str) -> dt.date:
    return value if isinstance(value, dt.date) else dt.date.fromisoformat(value)
