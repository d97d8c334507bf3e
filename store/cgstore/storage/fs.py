"""The local-directory driver: the embedded default, one machine, no services.

A plain object store over a directory tree (``ObjectStore`` in base.py: keys
are relative paths); verifying blobs is done above it, once for every driver
(``writer.py``). Layout under the root (the same keys as the S3 driver)::

    blobs/<hex[:2]>/<hex>    committed blobs, immutable
    tmp/<name>.<rand>.part   one file per in-flight write (``open_write``)
    uploads/<session_id>     the staged bytes of one resumable upload session

Durability and atomicity come from the filesystem: a write goes to its own
temp file; publishing it fsyncs it, ``os.replace``s it onto its final name and
fsyncs the directory. ``os.replace`` is atomic, so a reader sees either no
object or the whole object, and two identical concurrent writes both succeed
and leave one file. A discarded write deletes its temp file, so nothing the
verifier above refused is ever visible.

Staged uploads append to one file per session. The caller records a new
offset with a compare-and-set *after* an append finishes, so two racing
appends at one offset both reach storage and only one is recorded. Overwriting
at the offset would let the loser corrupt the winner's bytes; instead every
append goes to the current end of the file, under an exclusive ``flock``
(taken without waiting: a session busy with another append or a commit answers
416 at once, so no worker thread ever waits on a slow client's append), and
the session state lists the live ``[file_position, length]`` extents. Bytes no
extent names (a loser's, a crashed append's) are dead. An append ends with an
fsync before it returns (the recorded offset must never run ahead of durable
bytes); one that fails midway (its stream raised: a client gone, a chunk
shorter or longer than its Content-Range) truncates the file back to where it
started, and ``stage_discard`` cuts a race loser's bytes when they are the
file's tail, so the file stays at the committed offset but for a loser whose
bytes a winner's follow (reclaimed at commit).

``stage_commit`` verifies the live extents: from the hash the appends kept
when this process made them all (``base.Storage.staged_verifier``), else by
reading them back (streaming). In the usual case they are contiguous from
byte 0: the dead tail is cut and the file is renamed into ``blobs/``.
Otherwise the live extents are copied through a verified write.
The lock also keeps a late append from writing into a file that a commit has
just renamed into ``blobs/``: after locking, an append checks that the path
still names its file.

``tmp/`` can keep files of processes killed mid-write; ``sweep_orphans``
removes those older than a given age.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from cgstore.core.errors import BlobUploadUnknown, DigestInvalid, RangeInvalid, SizeInvalid, Unavailable
from cgstore.core.private import DIR_MODE, FILE_MODE, private_dir
from cgstore.storage.base import ObjectInfo, ObjectMissing, StagedUpload, StageWriter, Storage
from cgstore.storage.hashing import (
    READ_CHUNK_BYTES,
    StreamVerifier,
    blob_key,
    check_session_id,
    is_session_id,
    parse_digest,
)
from cgstore.storage.writer import PendingObject


def root_from_url(url: str) -> Path:
    """A directory path, or a ``file://`` URL naming one."""
    if url.startswith("file:"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"storage URL {url!r}: file URLs must name a local path")
        return Path(url2pathname(parsed.path))
    return Path(url)


def _os_cause(exc: OSError) -> str:
    """What failed, for the client: the errno and its text, never the path (it stays in the log)."""
    name = errno.errorcode.get(exc.errno, type(exc).__name__) if exc.errno else type(exc).__name__
    return f"{name}: {exc.strerror}" if exc.strerror else name


@contextlib.contextmanager
def _os_errors(operation: str) -> Iterator[None]:
    """A failing disk (EIO, ENOSPC, EACCES) is an outage to the caller, never a 500."""
    try:
        yield
    except OSError as exc:
        raise Unavailable(f"storage failed: {operation}", operation=operation, cause=_os_cause(exc)) from exc


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
    """Objects and staged uploads in a directory tree (see the module docstring)."""

    supports_presign = False

    def __init__(self, root: str | Path, *, max_blob_bytes: int | None = None) -> None:
        self.root = Path(root).absolute()
        self.max_blob_bytes = max_blob_bytes
        self.blobs_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self.uploads_dir = self.root / "uploads"
        private_dir(self.root)
        for directory in (self.blobs_dir, self.tmp_dir, self.uploads_dir):
            directory.mkdir(mode=DIR_MODE, exist_ok=True)

    @classmethod
    def from_settings(cls, settings) -> FileStorage:
        return cls(root_from_url(settings.resolved_storage_url), max_blob_bytes=settings.max_blob_bytes)

    # -- paths ---------------------------------------------------------------
    def _blob_path(self, hex_digest: str) -> Path:
        return self.root / blob_key(hex_digest)

    def _upload_path(self, session_id: str) -> Path:
        return self.uploads_dir / check_session_id(session_id)

    def _key_path(self, key: str) -> Path:
        # Keys come from this package (blob_key, staging names), never from a client;
        # still, none may leave the root.
        if Path(key).is_absolute() or ".." in Path(key).parts:
            raise ValueError(f"key {key!r} leaves the storage root")
        return self.root / key

    def _place(self, source: Path, key: str) -> None:
        """Atomically move an fsynced file onto ``key``, durably."""
        final = self._key_path(key)
        try:
            final.parent.mkdir(mode=DIR_MODE, parents=True)
            _fsync_dir(final.parent.parent)  # the new directory's own entry
        except FileExistsError:
            pass
        os.replace(source, final)
        _fsync_dir(final.parent)
        _fsync_dir(source.parent)  # the temp name's removal

    # -- object primitives --------------------------------------------------------
    def open_write(self, key: str, size_hint: int | None = None) -> PendingObject:
        return FilePendingObject(self, key)

    def stat(self, key: str) -> int | None:
        try:
            return self._key_path(key).stat().st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise Unavailable("storage failed: stat", operation="stat", cause=_os_cause(exc)) from exc

    def read_range(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        # Open now, not on first iteration: an absent object must raise before the
        # caller commits to a response.
        try:
            file = open(self._key_path(key), "rb")  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            raise ObjectMissing(key) from None
        except OSError as exc:
            raise Unavailable("storage failed: read", operation="read", cause=_os_cause(exc)) from exc
        return _stream_file(file, start, end)

    def list_keys(
        self, prefix: str, cursor: str | None = None, limit: int = 1000
    ) -> tuple[list[ObjectInfo], str | None]:
        """Keys in path-component order (a sorted walk), so a cursor resumes without a full listing."""
        after = tuple(cursor.split("/")) if cursor else ()
        found: list[ObjectInfo] = []
        with _os_errors("list"):
            for key in _walk_sorted(self.root, (), prefix, after):
                size = self.stat(key)
                if size is None:  # deleted while we walked
                    continue
                found.append(ObjectInfo(key, size))
                if len(found) == limit:
                    return found, key
        return found, None

    def delete_key(self, key: str) -> None:
        with _os_errors("delete"):
            self._key_path(key).unlink(missing_ok=True)

    # -- staged uploads ----------------------------------------------------------
    def stage_begin(self, session_id: str) -> StagedUpload:
        path = self._upload_path(session_id)
        with _os_errors("stage_begin"):
            try:
                # O_EXCL: session ids are fresh; never truncate another session's bytes.
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
            except FileExistsError:
                raise ValueError(f"upload session {session_id} already has staging") from None
            _fsync_dir(self.uploads_dir)
        return StagedUpload(session_id=session_id, offset=0, state={"extents": []})

    def _stage_writer(self, staged: StagedUpload) -> StageWriter:
        return FileStageWriter(self, staged)

    def stage_discard(self, before: StagedUpload, after: StagedUpload) -> None:
        new = _extents(after)[len(_extents(before)) :]
        if not new:
            return
        [[position, length]] = new  # one append adds one extent
        # Gone (committed, aborted) or busy (an append after ours: ours is not the tail).
        with contextlib.suppress(BlobUploadUnknown, RangeInvalid), self._locked_staging(after.session_id) as fd:
            with _os_errors("stage_discard"):
                # Only a tail can go: bytes after it are another append's, which
                # its own state names by file position.
                if os.fstat(fd).st_size == position + length:
                    os.ftruncate(fd, position)

    def stage_commit(self, staged: StagedUpload, digest: str) -> int:
        # A malformed digest is refused before anything is dropped: it is a bad
        # request, not evidence that the staged bytes are wrong.
        parse_digest(digest)
        extents = _extents(staged)
        path = self._upload_path(staged.session_id)
        with self._locked_staging(staged.session_id) as fd:
            with _os_errors("stage_commit"):
                file_size = os.fstat(fd).st_size
            if any(position + length > file_size for position, length in extents):
                raise BlobUploadUnknown("staged bytes are missing", session_id=staged.session_id)
            try:
                if _contiguous_from_zero(extents):
                    self._commit_in_place(fd, path, staged, extents, digest)
                else:
                    self._commit_by_copy(fd, staged, extents, digest)
            except (DigestInvalid, SizeInvalid):
                self.stage_abort(staged)
                raise
        return staged.offset

    def _commit_in_place(self, fd: int, path: Path, staged: StagedUpload, extents: list, digest: str) -> None:
        """The usual case (no retried or racing appends): verify, cut dead tail, rename.

        The stream's hash comes from the appends when this process made them all
        (``staged_verifier``); otherwise the staged bytes are read back and hashed.
        """
        verifier = self.staged_verifier(staged, digest)
        if verifier is None:
            verifier = StreamVerifier(digest, staged.offset)
            for data in _read_extents(fd, extents):
                verifier.update(data)
        verifier.verify()
        with _os_errors("stage_commit"):
            os.ftruncate(fd, staged.offset)  # drop a dead tail, if any
            os.fsync(fd)
            self._place(path, blob_key(verifier.hex))

    def _commit_by_copy(self, fd: int, staged: StagedUpload, extents: list, digest: str) -> None:
        """Dead bytes sit between live extents: copy the live ones through a verified write."""
        with self.writer(digest, staged.offset) as writer:
            for data in _read_extents(fd, extents):
                writer.write(data)
            writer.commit()
        with _os_errors("stage_commit"):
            self._upload_path(staged.session_id).unlink(missing_ok=True)

    def stage_abort(self, staged: StagedUpload) -> None:
        # No lock: an append still running writes into the unlinked inode, whose
        # bytes the kernel frees when it closes.
        with _os_errors("stage_abort"):
            self._upload_path(staged.session_id).unlink(missing_ok=True)

    def staged_sessions(self, written_before: dt.datetime) -> list[str]:
        cutoff = written_before.timestamp()
        found = []
        with _os_errors("list_staging"):
            for entry in os.scandir(self.uploads_dir):
                with contextlib.suppress(FileNotFoundError):  # committed or aborted meanwhile
                    if entry.stat().st_mtime < cutoff and is_session_id(entry.name):
                        found.append(entry.name)
        return found

    @contextlib.contextmanager
    def _locked_staging(self, session_id: str) -> Iterator[int]:
        """The session's staging file, opened and exclusively locked.

        After the lock is granted, the path must still name the locked file: a
        commit may have renamed it into ``blobs/`` (writing to it now would
        corrupt a visible blob) or an abort may have unlinked it.
        """
        path = self._upload_path(session_id)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise BlobUploadUnknown("no such upload session", session_id=session_id) from None
        except OSError as exc:
            raise Unavailable("storage failed: stage", operation="stage", cause=_os_cause(exc)) from exc
        try:
            try:
                # Never wait: the holder may be an append whose client is slow, and a
                # thread parked here would be one the whole API shares. Any other
                # append now starts at the same committed offset, so it would lose
                # the compare-and-set anyway.
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RangeInvalid("another chunk of this session is being written") from None
            with _os_errors("stage"):
                try:
                    still_ours = os.stat(path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    still_ours = False
            if not still_ours:
                raise BlobUploadUnknown("no such upload session", session_id=session_id)
            yield fd
        finally:
            os.close(fd)  # also releases the lock

    # -- operations ------------------------------------------------------------------
    def ping(self) -> None:
        for directory in (self.blobs_dir, self.tmp_dir, self.uploads_dir):
            if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
                # The directory's role, not its absolute path: clients learn what failed, not where.
                raise Unavailable("storage directory is missing or not writable", directory=directory.name)

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


def _extents(staged: StagedUpload) -> list[list[int]]:
    """The live ``[file_position, length]`` extents, in stream order; they must add up to the offset."""
    extents = [[int(position), int(length)] for position, length in staged.state.get("extents", [])]
    if sum(length for _, length in extents) != staged.offset:
        raise BlobUploadUnknown("staged extents do not reach the offset", session_id=staged.session_id)
    return extents


def _contiguous_from_zero(extents: list[list[int]]) -> bool:
    expected = 0
    for position, length in extents:
        if position != expected:
            return False
        expected += length
    return True


def _read_extents(fd: int, extents: list[list[int]]) -> Iterator[bytes]:
    """Yield the extents' bytes in bounded chunks (``pread``: no shared file position)."""
    with _os_errors("stage_commit"):
        for position, length in extents:
            end = position + length
            while position < end:
                data = os.pread(fd, min(READ_CHUNK_BYTES, end - position), position)
                if not data:
                    raise BlobUploadUnknown("staged bytes are missing")
                position += len(data)
                yield data


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
            raise Unavailable("storage failed: read", operation="read", cause=_os_cause(exc)) from exc


def _walk_sorted(directory: Path, parts: tuple[str, ...], prefix: str, after: tuple[str, ...]) -> Iterator[str]:
    """Keys of the files under ``directory`` that start with ``prefix`` and come after
    ``after``, in path-component order; subtrees that cannot match are never entered."""
    try:
        entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
    except FileNotFoundError:
        return
    for entry in entries:
        here = (*parts, entry.name)
        key = "/".join(here)
        if entry.is_dir(follow_symlinks=False):
            # Enter only what the prefix allows and what does not lie wholly before the cursor.
            if not (key + "/").startswith(prefix) and not prefix.startswith(key + "/"):
                continue
            if here < after[: len(here)]:
                continue
            yield from _walk_sorted(Path(entry.path), here, prefix, after)
        elif key.startswith(prefix) and here > after:
            yield key


class FilePendingObject(PendingObject):
    """One write: a private temp file, renamed onto its key when published."""

    def __init__(self, storage: FileStorage, key: str) -> None:
        self._storage = storage
        self._key = key
        self._temp_path = storage.tmp_dir / f"{Path(key).name}.{uuid.uuid4().hex}.part"
        with _os_errors("write"):
            self._fd: int | None = os.open(self._temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)

    def write(self, chunk: bytes) -> None:
        if self._fd is None:
            raise RuntimeError("write after publish or discard")
        with _os_errors("write"):
            _write_all(self._fd, chunk)

    def publish(self) -> None:
        if self._fd is None:
            raise RuntimeError("publish after publish or discard")
        with _os_errors("commit"):
            os.fsync(self._fd)  # on disk before the rename makes it visible
            os.close(self._fd)
            self._fd = None
            self._storage._place(self._temp_path, self._key)

    def discard(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        # After a publish the temp name is gone; missing_ok covers it.
        with contextlib.suppress(OSError):
            self._temp_path.unlink(missing_ok=True)


class FileStageWriter(StageWriter):
    """One append to a session's staging file, under its lock from start to finish or abort.

    Bytes go after everything in the file, never at the offset: bytes past the
    offset may be a crashed append's or those of a racing append whose
    compare-and-set on the offset has not landed yet. ``finish`` fsyncs before
    it returns (the recorded offset must never run ahead of durable bytes); an
    abort cuts the file back to where this append started.
    """

    def __init__(self, storage: FileStorage, staged: StagedUpload) -> None:
        self._storage = storage
        self._staged = staged
        self._written = 0
        self._lock = contextlib.ExitStack()
        self._fd: int | None = self._lock.enter_context(storage._locked_staging(staged.session_id))
        try:
            with _os_errors("stage_append"):
                self._position = os.fstat(self._fd).st_size
                os.lseek(self._fd, self._position, os.SEEK_SET)
        except BaseException:
            self._release()
            raise

    def write(self, chunk: bytes) -> None:
        if self._fd is None:
            raise RuntimeError("write after finish or abort")
        try:
            with _os_errors("stage_append"):
                _write_all(self._fd, chunk)
            self._written += len(chunk)
        except BaseException:
            self.abort()
            raise

    def finish(self) -> StagedUpload:
        if self._fd is None:
            raise RuntimeError("finish after finish or abort")
        try:
            with _os_errors("stage_append"):
                os.fsync(self._fd)  # durable before the caller records the new offset
        except BaseException:
            self.abort()
            raise
        self._release()
        extents = _extents(self._staged)
        if self._written:
            extents.append([self._position, self._written])
        staged = self._staged
        return StagedUpload(staged.session_id, staged.offset + self._written, {**staged.state, "extents": extents})

    def abort(self) -> None:
        if self._fd is None:
            return
        # Best effort: bytes left behind are dead (no extent names them).
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._position)
        self._release()

    def _release(self) -> None:
        self._fd = None
        self._lock.close()  # closes the file, which releases the lock
