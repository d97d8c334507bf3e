"""Verification written once, above every driver: the blob writers and the size limit.

A driver (``fs``, ``s3``) is a plain object store: among its primitives, it
streams bytes towards a key and later publishes them there atomically, or
discards them (``PendingObject``). Whether bytes deserve to be published is
decided here, the same way for every driver, as distribution's blob writer
does for all of its drivers: ``VerifiedWriter`` hashes the stream (blake3)
and counts it against the declared size and the store's limit while it flows
to the driver, and publishes only when size and digest both match; anything
else (a mismatch, an error, an abort) discards the pending object, so nothing
unverified is ever visible. ``within_limit`` applies the same limit to the
chunks of a resumable upload.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

from cgstore.core.errors import TooLarge
from cgstore.storage.hashing import StreamVerifier


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


def within_limit(chunks: Iterator[bytes], offset: int, limit: int | None) -> Iterator[bytes]:
    """The chunks of a staged append that starts at ``offset``, refused (``TooLarge``)
    from inside the stream once the upload would pass ``limit``: raised there, the
    driver cuts back what it already wrote of this append."""
    total = offset
    for chunk in chunks:
        total += len(chunk)
        if limit is not None and total > limit:
            raise TooLarge("blob exceeds the store's size limit", limit=limit)
        yield chunk
