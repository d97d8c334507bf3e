"""Verification written once, above every driver: the blob writers and the size limit.

A driver (``fs``, ``s3``) is a plain object store: among its primitives, it
streams bytes towards a key and later publishes them there atomically, or
discards them (``PendingObject``). Whether bytes deserve to be published is
decided here, the same way for every driver, as distribution's blob writer
does for all of its drivers: ``VerifiedWriter`` hashes the stream (blake3)
and counts it against the declared size and the store's limit while it flows
to the driver, and publishes only when size and digest both match; anything
else (a mismatch, an error, an abort) discards the pending object, so nothing
unverified is ever visible. ``LimitedStageWriter`` applies the same limit to
the chunks of a resumable upload, and ``HashingStageWriter`` hashes them as
they are staged, so a commit can verify the whole stream without reading it
back (``hashing.StreamHashes``).

This module is the layer below ``base.py``: it imports nothing of it, and
``base`` re-exports the writer types (``StagedUpload`` included) as the
interface drivers implement.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from cgstore.core.errors import TooLarge
from cgstore.storage.hashing import STREAM_HASH_FIELD, StreamHashes, StreamVerifier


@dataclass
class StagedUpload:
    """Backend bookkeeping for the bytes of one resumable upload session.

    ``state`` is JSON-serializable and stored in the session's database row, so
    any server process can continue the session.
    """

    session_id: str
    offset: int = 0
    state: dict = field(default_factory=dict)


class PendingObject(abc.ABC):
    """Bytes on their way to one key of a driver, invisible there until ``publish``."""

    @abc.abstractmethod
    def write(self, chunk: bytes) -> None:
        """Store the next bytes (may block while earlier ones drain)."""

    @abc.abstractmethod
    def publish(self) -> None:
        """Make everything written visible at the key, atomically and durably."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Drop everything written; nothing appears at the key. Idempotent."""


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


class VerifiedWriter(BlobWriter):
    """Hash and count on the way in; publish the driver's pending object only on a match."""

    def __init__(self, verifier: StreamVerifier, pending: PendingObject) -> None:
        self._verifier = verifier
        self._pending = pending
        self._state = "open"

    def write(self, chunk: bytes) -> None:
        if self._state != "open":
            raise RuntimeError(f"write on a {self._state} writer")
        try:
            # Verified first: bytes past the declared size or the limit never reach the driver.
            self._verifier.update(chunk)
            self._pending.write(chunk)
        except BaseException:
            self.abort()
            raise

    def commit(self) -> int:
        if self._state != "open":
            raise RuntimeError(f"commit on a {self._state} writer")
        try:
            self._verifier.verify()
            self._pending.publish()
        except BaseException:
            self.abort()
            raise
        self._state = "committed"
        return self._verifier.size

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"
            self._pending.discard()


class VerifyOnlyWriter(BlobWriter):
    """A writer for a blob that is already stored: verifies the stream, writes nothing.

    Knowing a digest grants nothing, so a repo that re-sends existing bytes must
    still send all of them, and they are checked exactly like a real write.
    """

    def __init__(self, digest: str, size: int | None = None, max_bytes: int | None = None) -> None:
        self._verifier = StreamVerifier(digest, size, max_bytes)

    def write(self, chunk: bytes) -> None:
        self._verifier.update(chunk)

    def commit(self) -> int:
        self._verifier.verify()
        return self._verifier.size

    def abort(self) -> None:
        """Nothing was written, so there is nothing to discard."""


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


class LimitedStageWriter(StageWriter):
    """A driver's stage writer, refused (``TooLarge``) as soon as the upload would pass
    the store's size limit; refusing aborts the driver's writer, which cuts back
    what this append already wrote."""

    def __init__(self, inner: StageWriter, offset: int, limit: int | None) -> None:
        self._inner = inner
        self._total = offset
        self._limit = limit

    def write(self, chunk: bytes) -> None:
        self._total += len(chunk)
        if self._limit is not None and self._total > self._limit:
            self._inner.abort()
            raise TooLarge("blob exceeds the store's size limit", limit=self._limit)
        self._inner.write(chunk)

    def finish(self) -> StagedUpload:
        return self._inner.finish()

    def abort(self) -> None:
        self._inner.abort()


class HashingStageWriter(StageWriter):
    """A stage writer that continues the stream's blake3 state over the append.

    The state comes from ``StreamHashes`` (none when this process does not hold
    the one the session's recorded state names: then the append stages as
    usual and its state names no hash). Bytes are hashed after the driver took
    them, so the kept state covers exactly what the returned state names.
    """

    def __init__(self, inner: StageWriter, staged: StagedUpload, hashes: StreamHashes) -> None:
        self._inner = inner
        self._hashes = hashes
        self._state = hashes.resume(staged.state, staged.offset)

    def write(self, chunk: bytes) -> None:
        self._inner.write(chunk)
        if self._state is not None:
            self._state.update(chunk)

    def finish(self) -> StagedUpload:
        staged = self._inner.finish()
        state = {k: v for k, v in staged.state.items() if k != STREAM_HASH_FIELD}
        if self._state is not None and self._state.size == staged.offset:
            state[STREAM_HASH_FIELD] = self._hashes.keep(self._state)
        staged.state = state
        return staged

    def abort(self) -> None:
        self._state = None
        self._inner.abort()
