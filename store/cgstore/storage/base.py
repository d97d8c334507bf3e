"""The storage interface both backends implement.

Contract, shared by both backends:
- A blob lives under a key derived from its digest. It becomes visible (``size``
  answers, ``read`` works) only after a write whose blake3 digest and size both
  matched what the caller expected; a mismatch or an abort leaves nothing.
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
from collections.abc import Iterator
from dataclasses import dataclass, field


class BlobWriter(abc.ABC):
    """One verified write of one blob whose digest is known up front."""

    @abc.abstractmethod
    def write(self, chunk: bytes) -> None:
        """Hash and store the next bytes. May block while earlier parts drain."""

    @abc.abstractmethod
    def commit(self) -> int:
        """Verify digest and size, make the blob visible, return its size.

        On a mismatch, everything written is discarded before the error is raised.
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything written. Safe to call more than once, or after commit fails."""

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


class StageWriter(abc.ABC):
    """One append to an upload session's staging, fed chunk by chunk.

    Push-style, like ``BlobWriter``, so the HTTP layer can read a slow body on
    the event loop and hand each batch to ``write`` in a short worker-thread
    call: no thread waits on a client.
    """

    @abc.abstractmethod
    def write(self, chunk: bytes) -> None:
        """Stage the next bytes."""

    @abc.abstractmethod
    def finish(self) -> StagedUpload:
        """Make the staged bytes durable and return the state that names them."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard this append's bytes (the state before it stays valid). Idempotent."""

    def __enter__(self) -> StageWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


@dataclass
class StagedUpload:
    """Backend bookkeeping for the bytes of one resumable upload session.

    ``state`` is JSON-serializable and stored in the session's database row, so
    any server process can continue the session.
    """

    session_id: str
    offset: int = 0
    state: dict = field(default_factory=dict)


class Storage(abc.ABC):
    """Blob bytes by digest, plus staged bytes of upload sessions."""

    #: True when ``presigned_url`` can answer (S3); the fs backend streams itself.
    supports_presign: bool = False

    # -- blobs -------------------------------------------------------------
    @abc.abstractmethod
    def writer(self, digest: str, size: int | None = None) -> BlobWriter:
        """Start a verified write of the blob ``digest`` (and ``size`` if known)."""

    @abc.abstractmethod
    def size(self, digest: str) -> int | None:
        """The stored blob's size, or None when absent."""

    @abc.abstractmethod
    def read(self, digest: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Stream bytes ``[start, end)`` (``end`` None: to the end). Absent: ``BlobUnknown``."""

    def presigned_url(self, digest: str, ttl_s: int) -> str | None:
        """A short-lived URL to GET the blob directly from storage, if supported."""
        return None

    def presigned_urls(self, digests: list[str], ttl_s: int) -> dict[str, str]:
        """``presigned_url`` for many blobs at once (a resolve answer needs hundreds)."""
        urls = {digest: self.presigned_url(digest, ttl_s) for digest in digests}
        return {digest: url for digest, url in urls.items() if url is not None}

    @abc.abstractmethod
    def delete(self, digest: str) -> None:
        """Remove a blob (garbage collection). Absent is not an error."""

    # -- staged uploads (resumable sessions) -------------------------------
    @abc.abstractmethod
    def stage_begin(self, session_id: str) -> StagedUpload:
        """Prepare empty staging for a new upload session."""

    @abc.abstractmethod
    def stage_writer(self, staged: StagedUpload) -> StageWriter:
        """Start appending a chunk at ``staged.offset``; ``finish`` returns the new state.

        If the stream fails midway, the persisted state must still describe
        only fully staged chunks (the client retries from there).

        Only the returned state names staged bytes. Callers record it by
        compare-and-set on the offset *after* ``finish``, so two appends from
        the same state may both run: neither may disturb the bytes the other's
        state names, and bytes named by no recorded state (a lost race, a
        crashed process) are reclaimed by ``stage_commit`` / ``stage_abort``.
        """

    def stage_append(self, staged: StagedUpload, chunks: Iterator[bytes]) -> StagedUpload:
        """Append a chunk given as an iterator (``stage_writer`` for callers that pull)."""
        with self.stage_writer(staged) as writer:
            for chunk in chunks:
                writer.write(chunk)
            return writer.finish()

    @abc.abstractmethod
    def stage_commit(self, staged: StagedUpload, digest: str) -> int:
        """Verify the whole staged stream against ``digest``; on a match make it the
        blob ``digest`` and drop the staging; on a mismatch drop the staging and
        raise ``DigestInvalid``. Returns the blob size."""

    @abc.abstractmethod
    def stage_abort(self, staged: StagedUpload) -> None:
        """Drop everything staged for the session. Idempotent."""

    # -- operations ----------------------------------------------------------
    @abc.abstractmethod
    def ping(self) -> None:
        """Raise ``Unavailable`` unless the backend answers."""

    def sweep_orphans(self, older_than_s: float) -> int:
        """Reclaim the bytes of blob writes whose process died mid-write (fs temp
        files, S3 multipart uploads under ``blobs/``) started more than
        ``older_than_s`` ago; return how many were reclaimed. Staged uploads are
        not touched: their sessions own them (``stage_abort``)."""
        return 0
