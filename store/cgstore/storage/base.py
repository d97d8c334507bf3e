"""The storage interface: thin drivers below, verified blobs above, once.

A driver (``fs.py``, the ``s3`` package) implements ``ObjectStore``: a plain object
store of keys (``blobs/<hex[:2]>/<hex>``, ``uploads/…``) that can stream bytes
to a key and publish them atomically (``open_write`` → ``PendingObject``),
read a range, stat, list by prefix with a cursor, delete and presign. It knows
nothing of digests. ``Storage`` builds the blob operations on those primitives
for every driver alike: digests parsed into keys, and each write verified by
``writer.VerifiedWriter`` (streaming blake3, the declared size, the store's
size limit) and published only on a match. Staged uploads (resumable
sessions) stay per driver, since their layout is what makes each one cheap,
but their size limit is applied here, once, and so is their hashing: each
append continues the stream's blake3 state in this process
(``hashing.StreamHashes``), and a commit verifies from it when it can
(``staged_verifier``), reading the staged bytes back only when it cannot.

Contract, shared by both backends:
- A blob becomes visible (``size`` answers, ``read`` works) only after a write
  whose blake3 digest and size both matched what the caller expected; a
  mismatch or an abort leaves nothing.
- Writes stream: bytes are hashed while they flow to storage, and memory stays
  bounded by a few parts whatever the blob size.
- Two identical concurrent writes both succeed and leave one object.
- Infrastructure failures (the store unreachable, 5xx) raise
  ``cgstore.core.errors.Unavailable``; verification failures raise
  ``DigestInvalid`` / ``SizeInvalid``; a missing blob or staged upload raises
  ``BlobUnknown`` / ``BlobUploadUnknown``.
"""

from __future__ import annotations

import abc
import datetime as dt
import functools
from collections.abc import Iterator
from dataclasses import dataclass

from cgstore.core.errors import BlobUnknown
from cgstore.storage.hashing import (
    StreamHashes,
    StreamVerifier,
    blob_key,
    check_range,
    parse_digest,
    refuse_past_limit,
)
from cgstore.storage.writer import (
    BlobWriter,
    HashingStageWriter,
    LimitedStageWriter,
    PendingObject,
    StagedUpload,
    StageWriter,
    VerifiedWriter,
    VerifyOnlyWriter,
)

__all__ = [
    "BlobWriter",
    "ObjectInfo",
    "ObjectMissing",
    "ObjectStore",
    "PendingObject",
    "StageWriter",
    "StagedUpload",
    "Storage",
]


class ObjectMissing(LookupError):
    """A driver found no object at the key (the blob layer turns it into ``BlobUnknown``)."""


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key (relative to the driver's root) and size."""

    key: str
    size: int


class ObjectStore(abc.ABC):
    """The driver primitives: a plain object store. Keys are relative (``blobs/…``)."""

    #: True when ``presign_key`` can answer (S3); the fs backend streams itself.
    supports_presign: bool = False

    @abc.abstractmethod
    def open_write(self, key: str, size_hint: int | None = None) -> PendingObject:
        """Start streaming bytes to ``key``; nothing is visible there until ``publish``."""

    @abc.abstractmethod
    def stat(self, key: str) -> int | None:
        """The object's size, or None when absent."""

    @abc.abstractmethod
    def read_range(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Stream bytes ``[start, end)`` of the object; ``ObjectMissing`` (raised before
        returning, so a caller can still answer 404) when absent."""

    @abc.abstractmethod
    def list_keys(
        self, prefix: str, cursor: str | None = None, limit: int = 1000
    ) -> tuple[list[ObjectInfo], str | None]:
        """Up to ``limit`` objects whose key starts with ``prefix``, after ``cursor`` (the
        last key of the previous page, None to start), and the cursor of the next page
        (None once the listing is complete). Order is the driver's own, stable one."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> None:
        """Remove the object. Absent is not an error."""

    def presign_key(self, key: str, ttl_s: int) -> str | None:
        """A short-lived URL to GET the object directly from storage, if supported."""
        return None


class Storage(ObjectStore):
    """Blob bytes by digest, verified once for every driver, plus staged upload sessions."""

    #: The store's size limit (``CGSTORE_MAX_BLOB_BYTES``); None: unlimited. Applied
    #: here and nowhere else below the service.
    max_blob_bytes: int | None = None

    # -- blobs (built on the primitives, the same for every driver) -------------
    def writer(self, digest: str, size: int | None = None) -> BlobWriter:
        """Start a verified write of the blob ``digest`` (and ``size`` if known)."""
        verifier = StreamVerifier(digest, size, self.max_blob_bytes)
        return VerifiedWriter(verifier, self.open_write(blob_key(verifier.hex), size))

    def verify_only(self, digest: str, size: int | None = None) -> BlobWriter:
        """A writer that verifies a re-sent stream of a blob already stored, writing nothing."""
        return VerifyOnlyWriter(digest, size, self.max_blob_bytes)

    def size(self, digest: str) -> int | None:
        """The stored blob's size, or None when absent."""
        return self.stat(blob_key(parse_digest(digest)))

    def read(self, digest: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Stream bytes ``[start, end)`` (``end`` None: to the end). Absent: ``BlobUnknown``."""
        key = blob_key(parse_digest(digest))
        check_range(start, end)
        try:
            return self.read_range(key, start, end)
        except ObjectMissing:
            raise BlobUnknown("blob unknown", digest=digest) from None

    def presigned_url(self, digest: str, ttl_s: int) -> str | None:
        """A short-lived URL to GET the blob directly from storage, if supported."""
        return self.presign_key(blob_key(parse_digest(digest)), ttl_s)

    def presigned_urls(self, digests: list[str], ttl_s: int) -> dict[str, str]:
        """``presigned_url`` for many blobs at once (a resolve answer needs hundreds)."""
        urls = {digest: self.presigned_url(digest, ttl_s) for digest in digests}
        return {digest: url for digest, url in urls.items() if url is not None}

    def delete(self, digest: str) -> None:
        """Remove a blob (garbage collection). Absent is not an error."""
        self.delete_key(blob_key(parse_digest(digest)))

    def delete_many(self, digests: list[str]) -> None:
        """Remove several blobs (garbage collection batches). Absent ones are not an error."""
        for digest in digests:
            self.delete(digest)

    # -- staged uploads (resumable sessions) -------------------------------
    @abc.abstractmethod
    def stage_begin(self, session_id: str) -> StagedUpload:
        """Prepare empty staging for a new upload session."""

    def stage_writer(self, staged: StagedUpload, length: int | None = None) -> StageWriter:
        """Start appending a chunk at ``staged.offset``; ``finish`` returns the new state.

        The store's size limit is applied here, once for every driver
        (``writer.LimitedStageWriter``): to the declared ``length`` before
        anything is staged (``TooLarge`` at once, so the caller can answer
        without reading a body it would refuse), then to the bytes as they come.

        If the stream fails midway (the client went away, the chunk passed the
        size limit, or the caller aborts the writer because the chunk broke its
        declared length), nothing of this append stays staged: ``abort`` cuts
        back or discards the bytes it wrote.

        Only the returned state names staged bytes. Callers record it by
        compare-and-set on the offset *after* ``finish``, so two appends from
        the same state may both run: neither may disturb the bytes the other's
        state names, and bytes named by no recorded state (a lost race, a
        crashed process) are reclaimed by ``stage_commit`` / ``stage_abort``.
        """
        refuse_past_limit(None if length is None else staged.offset + length, self.max_blob_bytes)
        limited = LimitedStageWriter(self._stage_writer(staged), staged.offset, self.max_blob_bytes)
        return HashingStageWriter(limited, staged, self.stream_hashes)

    @functools.cached_property
    def stream_hashes(self) -> StreamHashes:
        """The blake3 states of this process's staged appends (see ``hashing.StreamHashes``)."""
        return StreamHashes()

    def staged_verifier(self, staged: StagedUpload, digest: str) -> StreamVerifier | None:
        """A verifier that has seen the whole staged stream, if this process hashed it
        as it was staged; None when the driver must read the staged bytes back."""
        state = self.stream_hashes.resume(staged.state, staged.offset)
        return None if state is None else StreamVerifier.resumed(digest, state, self.max_blob_bytes)

    @abc.abstractmethod
    def _stage_writer(self, staged: StagedUpload) -> StageWriter:
        """The driver's append at ``staged.offset`` (the limit is applied around it)."""

    def stage_append(self, staged: StagedUpload, chunks: Iterator[bytes]) -> StagedUpload:
        """Append a chunk given as an iterator (``stage_writer`` for callers that pull)."""
        with self.stage_writer(staged) as writer:
            for chunk in chunks:
                writer.write(chunk)
            return writer.finish()

    @abc.abstractmethod
    def stage_discard(self, before: StagedUpload, after: StagedUpload) -> None:
        """Reclaim the bytes of an append that will never be recorded.

        ``after`` is what the append from ``before`` finished with, and the caller's
        compare-and-set refused it (another chunk won the offset). Bytes any other
        state may name are left alone; what cannot be reclaimed now is dead and
        goes with ``stage_commit`` / ``stage_abort``.
        """

    def stage_recorded(self, before: StagedUpload, after: StagedUpload) -> None:
        """The append from ``before`` was recorded as ``after`` (the compare-and-set won):
        bytes only ``before`` named may go now. Best effort: what stays is dropped with
        the session (``stage_commit`` / ``stage_abort``). Nothing to do by default."""

    @abc.abstractmethod
    def stage_commit(self, staged: StagedUpload, digest: str) -> int:
        """Verify the whole staged stream against ``digest``; on a match make it the
        blob ``digest`` and drop the staging; on a mismatch drop the staging and
        raise ``DigestInvalid``. Returns the blob size."""

    @abc.abstractmethod
    def stage_abort(self, staged: StagedUpload) -> None:
        """Drop everything staged for the session. Idempotent."""

    @abc.abstractmethod
    def staged_sessions(self, written_before: dt.datetime) -> list[str]:
        """The session ids whose staging was last written before ``written_before``
        (garbage collection drops those no session row names any more)."""

    # -- operations ----------------------------------------------------------
    @abc.abstractmethod
    def ping(self) -> None:
        """Raise ``Unavailable`` unless the backend answers."""

    def sweep_orphans(self, older_than_s: float) -> int:
        """Reclaim the bytes of blob writes whose process died mid-write (fs temp
        files, S3 multipart uploads under ``blobs/``) started more than
        ``older_than_s`` ago; return how many were reclaimed. Staged uploads are
        not touched: their sessions own them (``stage_abort``), and garbage collection
        drops those no session names any more (``staged_sessions``)."""
        return 0
