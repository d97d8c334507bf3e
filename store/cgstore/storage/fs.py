"""The local-directory backend: the embedded default, one machine, no services.

Layout under the root (the same keys as the S3 backend)::

    blobs/<hex[:2]>/<hex>   committed blobs, immutable
    tmp/<hex>.<rand>.part   one file per in-flight verified write
    uploads/<session_id>    the staged bytes of one resumable upload session

Durability and atomicity come from the filesystem: a write goes to its own
temp file, is verified (size, then blake3), fsynced, then ``os.replace``d onto
its final name and the directory is fsynced. ``os.replace`` is atomic, so a
reader sees either no blob or the whole blob, and two identical concurrent
writes both succeed and leave one file. A mismatch deletes the temp file, so
nothing is ever visible under ``blobs/`` that was not verified.

Staged uploads append to one file per session. Each append ends with an fsync
before it returns, because the caller then records the new offset in the
database: the recorded offset must never run ahead of durable bytes. A chunk
that fails midway is truncated back to the offset it started at, and an append
also truncates any tail a crashed process left past the recorded offset.
Callers serialize appends per session (the service holds the session's row).

``tmp/`` can keep files of processes killed mid-write; ``sweep_orphans``
removes those older than a given age.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from cgstore.core.errors import BlobUnknown, BlobUploadUnknown, DigestInvalid, SizeInvalid, TooLarge, Unavailable
from cgstore.storage.base import BlobWriter, StagedUpload, Storage
from cgstore.storage.hashing import (
    READ_CHUNK_BYTES,
    StreamVerifier,
    blob_key,
    check_range,
    check_session_id,
    parse_digest,
)


def root_from_url(url: str) -> Path:
    """A directory path, or a ``file://`` URL naming one."""
    if url.startswith("file:"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"storage URL {url!r}: file URLs must name a local path")
        return Path(url2pathname(parsed.path))
    return Path(url)


@contextlib.contextmanager
def _os_errors(operation: str) -> Iterator[None]:
    """A failing disk (EIO, ENOSPC, EACCES) is an outage to the caller, never a 500."""
    try:
        yield
    except OSError as exc:
        raise Unavailable("storage failed", operation=operation, cause=f"{type(exc).__name__}: {exc}") from exc


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """``os.write`` may write less than asked; loop until every byte is down."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileStorage(Storage):
    """Blobs and staged uploads in a directory tree (see the module docstring)."""

    supports_presign = False

    def __init__(self, root: str | Path, *, max_blob_bytes: int | None = None) -> None:
        self.root = Path(root).absolute()
        self.max_blob_bytes = max_blob_bytes
        self.blobs_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self.uploads_dir = self.root / "uploads"
        for directory in (self.blobs_dir, self.tmp_dir, self.uploads_dir):
            directory.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_settings(cls, settings) -> FileStorage:
        return cls(root_from_url(settings.resolved_storage_url), max_blob_bytes=settings.max_blob_bytes)

    # -- paths ---------------------------------------------------------------
    def _blob_path(self, hex_digest: str) -> Path:
        return self.root / blob_key(hex_digest)

    def _upload_path(self, session_id: str) -> Path:
        return self.uploads_dir / check_session_id(session_id)

    def _place(self, source: Path, hex_digest: str) -> None:
        """Atomically move a verified, fsynced file onto its blob name, durably."""
        final = self._blob_path(hex_digest)
        try:
            final.parent.mkdir()
            _fsync_dir(self.blobs_dir)  # the new shard directory's own entry
        except FileExistsError:
            pass
        os.replace(source, final)
        _fsync_dir(final.parent)
        _fsync_dir(source.parent)  # the temp name's removal

    # -- blobs -----------------------------------------------------------------
    def writer(self, digest: str, size: int | None = None) -> BlobWriter:
        verifier = StreamVerifier(digest, size, self.max_blob_bytes)
        return FileBlobWriter(self, verifier)

    def size(self, digest: str) -> int | None:
        path = self._blob_path(parse_digest(digest))
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise Unavailable("storage failed", operation="size", cause=str(exc)) from exc

    def read(self, digest: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        # Open now, not on first iteration: an absent blob must raise before the
        # caller commits to a response.
        path = self._blob_path(parse_digest(digest))
        check_range(start, end)
        try:
            file = open(path, "rb")  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            raise BlobUnknown("blob unknown", digest=digest) from None
        except OSError as exc:
            raise Unavailable("storage failed", operation="read", cause=str(exc)) from exc
        return _stream_file(file, start, end)

    def delete(self, digest: str) -> None:
        with _os_errors("delete"):
            self._blob_path(parse_digest(digest)).unlink(missing_ok=True)

    # -- staged uploads ----------------------------------------------------------
    def stage_begin(self, session_id: str) -> StagedUpload:
        path = self._upload_path(session_id)
        with _os_errors("stage_begin"):
            path.write_bytes(b"")
            _fsync_dir(self.uploads_dir)
        return StagedUpload(session_id=session_id, offset=0, state={})

    def stage_append(self, staged: StagedUpload, chunks: Iterator[bytes]) -> StagedUpload:
        path = self._upload_path(staged.session_id)
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            raise BlobUploadUnknown("no such upload session", session_id=staged.session_id) from None
        except OSError as exc:
            raise Unavailable("storage failed", operation="stage_append", cause=str(exc)) from exc
        try:
            _cut_to_offset(fd, staged)
            offset = self._append_chunks(fd, staged, chunks)
        finally:
            os.close(fd)
        return StagedUpload(session_id=staged.session_id, offset=offset, state=dict(staged.state))

    def _append_chunks(self, fd: int, staged: StagedUpload, chunks: Iterator[bytes]) -> int:
        """Write the chunks at the offset and fsync; on any failure cut back to the offset."""
        offset = staged.offset
        try:
            with _os_errors("stage_append"):
                os.lseek(fd, offset, os.SEEK_SET)
                for chunk in chunks:
                    if self.max_blob_bytes is not None and offset + len(chunk) > self.max_blob_bytes:
                        raise TooLarge("blob exceeds the store's size limit", limit=self.max_blob_bytes)
                    _write_all(fd, chunk)
                    offset += len(chunk)
                os.fsync(fd)
        except BaseException:
            # Best effort: if even the truncate fails, the next append truncates.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, staged.offset)
            raise
        return offset

    def stage_commit(self, staged: StagedUpload, digest: str) -> int:
        # A malformed digest is refused before anything is dropped: it is a bad
        # request, not evidence that the staged bytes are wrong.
        verifier = StreamVerifier(digest, staged.offset)
        path = self._upload_path(staged.session_id)
        try:
            file = open(path, "rb")  # noqa: SIM115 - closed right below
        except FileNotFoundError:
            raise BlobUploadUnknown("no such upload session", session_id=staged.session_id) from None
        with file, _os_errors("stage_commit"):
            staged_bytes = os.fstat(file.fileno()).st_size
            if staged_bytes < staged.offset:
                raise BlobUploadUnknown("staged bytes are missing", session_id=staged.session_id)
            for chunk in _stream_file(file, 0, staged.offset):
                verifier.update(chunk)
        try:
            verifier.verify()
        except (DigestInvalid, SizeInvalid):
            self.stage_abort(staged)
            raise
        with _os_errors("stage_commit"):
            if staged_bytes > staged.offset:  # a crashed append's tail is not part of the blob
                os.truncate(path, staged.offset)
                with open(path, "rb+") as tail_cut:
                    os.fsync(tail_cut.fileno())
            self._place(path, verifier.hex)
        return staged.offset

    def stage_abort(self, staged: StagedUpload) -> None:
        with _os_errors("stage_abort"):
            self._upload_path(staged.session_id).unlink(missing_ok=True)

    # -- operations ------------------------------------------------------------------
    def ping(self) -> None:
        for directory in (self.blobs_dir, self.tmp_dir, self.uploads_dir):
            if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
                raise Unavailable("storage directory is missing or not writable", path=str(directory))

    def sweep_orphans(self, older_than_s: float) -> int:
        """Delete temp files of writes that died more than ``older_than_s`` ago."""
        cutoff = time.time() - older_than_s
        removed = 0
        with _os_errors("sweep_orphans"):
            for entry in os.scandir(self.tmp_dir):
                with contextlib.suppress(FileNotFoundError):  # its writer may just have finished
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
        return removed


def _cut_to_offset(fd: int, staged: StagedUpload) -> None:
    """Drop bytes a crashed append left past the recorded offset; refuse lost bytes."""
    with _os_errors("stage_append"):
        staged_bytes = os.fstat(fd).st_size
        if staged_bytes > staged.offset:
            os.ftruncate(fd, staged.offset)
    if staged_bytes < staged.offset:
        raise BlobUploadUnknown("staged bytes are missing", session_id=staged.session_id)


def _stream_file(file, start: int, end: int | None) -> Iterator[bytes]:
    """Yield ``[start, end)`` of an open file in bounded chunks, then close it."""
    with file:
        try:
            file.seek(start)
            remaining = None if end is None else end - start
            while remaining is None or remaining > 0:
                want = READ_CHUNK_BYTES if remaining is None else min(READ_CHUNK_BYTES, remaining)
                data = file.read(want)
                if not data:
                    return
                if remaining is not None:
                    remaining -= len(data)
                yield data
        except OSError as exc:
            raise Unavailable("storage failed", operation="read", cause=str(exc)) from exc


class FileBlobWriter(BlobWriter):
    """One verified write: a private temp file, renamed into place on a match."""

    def __init__(self, storage: FileStorage, verifier: StreamVerifier) -> None:
        self._storage = storage
        self._verifier = verifier
        self._temp_path = storage.tmp_dir / f"{verifier.hex}.{uuid.uuid4().hex}.part"
        with _os_errors("write"):
            self._fd: int | None = os.open(self._temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, chunk: bytes) -> None:
        if self._fd is None:
            raise RuntimeError("write after commit or abort")
        try:
            self._verifier.update(chunk)
            with _os_errors("write"):
                _write_all(self._fd, chunk)
        except BaseException:
            self.abort()
            raise

    def commit(self) -> int:
        if self._fd is None:
            raise RuntimeError("commit after commit or abort")
        try:
            self._verifier.verify()
            with _os_errors("commit"):
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
                self._storage._place(self._temp_path, self._verifier.hex)
        except BaseException:
            self.abort()
            raise
        return self._verifier.size

    def abort(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        # After a successful commit the temp name is gone; missing_ok covers it.
        with contextlib.suppress(OSError):
            self._temp_path.unlink(missing_ok=True)
