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
repo the caller can read.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Generator, Iterator
from dataclasses import dataclass

from cgstore_client.keys import is_digest
from sqlalchemy import delete, func, select, update

from cgstore.audit.service import record
from cgstore.blobs.models import BLOB_OK, Blob, RepoBlob, UploadSession
from cgstore.context import StoreContext
from cgstore.core.db import insert_ignoring_conflicts, utcnow
from cgstore.core.http import BodyConsumer
from cgstore.core.errors import (
    BlobUnknown,
    BlobUploadUnknown,
    DigestInvalid,
    RangeInvalid,
    SizeInvalid,
    TooLarge,
)
from cgstore.core.faults import crash_point
from cgstore.operations.health import set_blob_health
from cgstore.repos.models import Repo
from cgstore.repos.service import readable_repo, writable_repo
from cgstore.storage import StagedUpload
from cgstore.storage.hashing import VerifyOnlyWriter
from cgstore.tokens.claims import Claims

MAX_MISSING_QUERY = 1024


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
        found = readable_repo(
            session, claims, owner, repo, BlobUnknown, "blob unknown to this repo", digest=digest
        )
        size = session.scalar(
            select(Blob.size)
            .join(RepoBlob, RepoBlob.digest == Blob.digest)
            .where(RepoBlob.repo_id == found.id, Blob.digest == digest)
        )
    if size is None:
        raise BlobUnknown("blob unknown to this repo", digest=digest)
    return BlobLocation(digest, size)


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
        linked = set(
            session.scalars(
                select(RepoBlob.digest)
                .join(Blob, Blob.digest == RepoBlob.digest)
                .where(RepoBlob.repo_id == target.id, RepoBlob.digest.in_(set(digests)), Blob.health == BLOB_OK)
            )
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
    _check_size_limit(ctx, declared_size)
    with ctx.db.session() as session:
        target = writable_repo(session, claims, owner, repo)
        stored = session.get(Blob, digest)
        # A blob the scrub found damaged is written again for real: that is how it heals.
        already_stored = stored is not None and stored.health == BLOB_OK
    # The writer checks size (as soon as too many bytes arrive), the store's limit and the digest.
    if already_stored:
        writer = VerifyOnlyWriter(digest, declared_size, ctx.settings.max_blob_bytes)
    else:
        writer = ctx.storage.writer(digest, declared_size)
    with writer:
        while (chunk := (yield)) is not None:
            writer.write(chunk)
        size = writer.commit()
    crash_point("upload.stored")
    _link(ctx, claims, target, digest, size, action="blob.upload", wrote=not already_stored)
    return size


def _check_size_limit(ctx: StoreContext, size: int | None) -> None:
    if size is not None and size > ctx.settings.max_blob_bytes:
        raise TooLarge(f"blobs are at most {ctx.settings.max_blob_bytes} bytes", limit=ctx.settings.max_blob_bytes)


def _link(
    ctx: StoreContext, claims: Claims, target: Repo, digest: str, size: int, action: str, *, wrote: bool, **detail
) -> None:
    """Link the blob into ``target``; ``wrote``: its bytes were just stored verified, which heals a damaged blob."""
    with ctx.db.session() as session:
        insert_ignoring_conflicts(session, Blob, digest=digest, size=size, created_at=utcnow())
        if wrote:
            set_blob_health(session, digest, BLOB_OK, actor=claims.sub, jti=claims.jti, detail={"via": action})
        linked = insert_ignoring_conflicts(
            session, RepoBlob, repo_id=target.id, digest=digest, linked_by=claims.sub, created_at=utcnow()
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
    source_owner, _, source_repo = source.partition("/")
    with ctx.db.session() as session:
        target = writable_repo(session, claims, owner, repo)
    location = locate(ctx, claims, source_owner, source_repo, digest)
    _link(ctx, claims, target, digest, location.size, action="blob.mount", wrote=False, source=source)
    return location.size


# -- resumable upload sessions -------------------------------------------------------

def _expiry(ctx: StoreContext) -> dt.datetime:
    return utcnow() + dt.timedelta(seconds=ctx.settings.upload_session_ttl_s)


def open_session(ctx: StoreContext, claims: Claims, owner: str, repo: str) -> str:
    with ctx.db.session() as session:
        target = writable_repo(session, claims, owner, repo)
    session_id = uuid.uuid4().hex
    staged = ctx.storage.stage_begin(session_id)
    with ctx.db.session() as session:
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
    return session_id


def _find_session(ctx: StoreContext, claims: Claims, owner: str, repo: str, session_id: str) -> UploadSession:
    """The caller's own live session in this repo; anything else is ``BLOB_UPLOAD_UNKNOWN``."""
    with ctx.db.session() as session:
        target = writable_repo(session, claims, owner, repo)
        found = session.get(UploadSession, session_id) if len(session_id) <= 64 else None
    if found is None or found.repo_id != target.id or found.principal != claims.sub or found.expires_at <= utcnow():
        raise BlobUploadUnknown("no such upload session", session=session_id[:64])
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
    """Stage one chunk (the body); it must start at the committed offset. Returns the new offset."""
    found = _find_session(ctx, claims, owner, repo, session_id)
    if content_range is not None and content_range[0] != found.offset:
        raise RangeInvalid("chunk does not start at the committed offset", offset=found.offset)
    expected = None if content_range is None else content_range[1] - content_range[0]
    limit = ctx.settings.max_blob_bytes
    received = 0
    with ctx.storage.stage_writer(StagedUpload(found.id, found.offset, found.storage_state)) as writer:
        while (chunk := (yield)) is not None:
            received += len(chunk)
            if expected is not None and received > expected:
                raise SizeInvalid("chunk longer than its Content-Range", expected=expected)
            if found.offset + received > limit:
                raise TooLarge(f"blobs are at most {limit} bytes", limit=limit)
            writer.write(chunk)
        staged = writer.finish()
    if expected is not None and staged.offset - found.offset != expected:
        raise SizeInvalid("chunk shorter than its Content-Range", expected=expected, received=staged.offset - found.offset)
    crash_point("session.staged")
    with ctx.db.session() as session:
        # Compare-and-set on the offset: of two racing chunks at one offset, one wins.
        moved = session.execute(
            update(UploadSession)
            .where(UploadSession.id == found.id, UploadSession.offset == found.offset)
            .values(offset=staged.offset, storage_state=staged.state, expires_at=_expiry(ctx))
        ).rowcount
    if not moved:
        raise RangeInvalid("another chunk was committed at this offset", offset=found.offset)
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
    staged = StagedUpload(found.id, found.offset, found.storage_state)
    try:
        size = ctx.storage.stage_commit(staged, digest)
    except DigestInvalid:
        # The storage dropped the staged bytes: a mismatch leaves nothing to resume.
        _forget_session(ctx, found.id)
        raise
    crash_point("commit.stored")
    _forget_session(ctx, found.id)
    with ctx.db.session() as session:
        target = session.get(Repo, found.repo_id)
    _link(ctx, claims, target, digest, size, action="blob.upload", wrote=True, session=found.id)
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


def reap_expired_sessions(ctx: StoreContext, now: dt.datetime | None = None) -> int:
    """Reclaim expired sessions' staged bytes and orphaned writes; returns how many were reaped."""
    now = now or utcnow()
    with ctx.db.session() as session:
        expired = list(session.scalars(select(UploadSession).where(UploadSession.expires_at <= now).limit(1000)))
    for found in expired:
        ctx.storage.stage_abort(StagedUpload(found.id, found.offset, found.storage_state))
        _forget_session(ctx, found.id)
    # Writes of a process that died mid-upload have no session row; a write idle
    # for as long as a session may be is abandoned too.
    orphans = ctx.storage.sweep_orphans(older_than_s=ctx.settings.upload_session_ttl_s)
    return len(expired) + orphans


def open_session_count(ctx: StoreContext) -> int:
    with ctx.db.session() as session:
        return session.scalar(select(func.count()).select_from(UploadSession).where(UploadSession.expires_at > utcnow()))
