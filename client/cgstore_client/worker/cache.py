"""The worker's local cache: immutable verified blobs, resolved records, crash-safe and shared.

Layout under the cache directory (``CGSTORE_CACHE_DIR``, default ``~/.cache/cgstore``)::

    CACHEDIR.TAG                  marks the directory as a cache (backup tools skip it)
    blobs/<algo>/<hex>            verified bytes, never modified once renamed into place
    records/<key>.json            the resolved record (with its receipt) a key was served from
    discover/<hex>.json           the last discover answer for a declaration (hex: its request's digest)
    stamps/<algo>/<hex>.json      verification stamp of a blob: size, mtime, inode, digest
    tmp/<hex>.<pid>.<rand>.part   in-flight downloads, one per process
    locks/<hex>.lock              one lock per digest, so processes booting together download once

A blob appears under ``blobs/`` only by an atomic rename of a temp file whose
digest and size were checked, so a crash or a kill leaves nothing visible. The
lock only saves work: two processes that both download write two temp files of
the same verified bytes and the second rename is harmless. A cached blob is
trusted without re-hashing only while its stamp still describes the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3
import filelock

from cgstore_client.errors import InsufficientSpace
from cgstore_client.keys import validate_digest

CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by cgstore_client.\n"
    "# For information about cache directory tags, see https://bford.info/cachedir/\n"
)
HASH_BUFFER = 1 << 20
#: Free space kept beyond a download's size, so a full disk never stalls the rest of the host.
SPARE_BYTES = 64 << 20


def default_dir() -> Path:
    return Path(os.environ.get("CGSTORE_CACHE_DIR") or Path.home() / ".cache" / "cgstore")


def _split(digest: str) -> tuple[str, str]:
    algo, _, hexdigest = validate_digest(digest).partition(":")
    return algo, hexdigest


def hash_file(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(blake3 digest, size) of a file, read in chunks."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    size = 0
    buffer = memoryview(bytearray(HASH_BUFFER))
    with open(path, "rb", buffering=0) as source:
        while n := source.readinto(buffer):
            hasher.update(buffer[:n])
            size += n
    return "blake3:" + hasher.hexdigest(), size


@dataclass(frozen=True)
class Stamp:
    """What a blob file looked like when its bytes were last verified."""

    digest: str
    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path, digest: str) -> Stamp:
        st = path.stat()
        return cls(digest, st.st_size, st.st_mtime_ns, st.st_ino)


class Cache:
    """The cache directory: paths, verification, temp files, locks, disk space."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else default_dir()

    # --- layout ------------------------------------------------------------------------

    def ensure(self) -> None:
        for sub in ("blobs", "records", "discover", "stamps", "tmp", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        tag = self.root / "CACHEDIR.TAG"
        if not tag.exists():
            tag.write_text(CACHEDIR_TAG)

    def blob_path(self, digest: str) -> Path:
        algo, hexdigest = _split(digest)
        return self.root / "blobs" / algo / hexdigest

    def record_path(self, key: str) -> Path:
        return self.root / "records" / f"{key}.json"

    def discover_path(self, request_digest: str) -> Path:
        _, hexdigest = _split(request_digest)
        return self.root / "discover" / f"{hexdigest}.json"

    def _stamp_path(self, digest: str) -> Path:
        algo, hexdigest = _split(digest)
        return self.root / "stamps" / algo / f"{hexdigest}.json"

    # --- blobs -------------------------------------------------------------------------

    def verified(self, digest: str, size: int | None = None) -> Path | None:
        """The cached blob's path when its bytes are ``digest`` (and ``size``), else None.

        Trusted without re-hashing while the stamp holds; re-hashed otherwise, and a
        blob that no longer matches is removed (the next fetch downloads it again).
        """
        path = self.blob_path(digest)
        try:
            current = Stamp.of(path, digest)
        except FileNotFoundError:
            return None
        if size is not None and current.size != size:
            self._evict(digest)
            return None
        if self._read_stamp(digest) != current and not self.rehash(digest):
            return None
        _mark_used(path, current)
        return path

    def rehash(self, digest: str) -> bool:
        """Hash the cached blob again: stamp it if it matches, remove it if not."""
        path = self.blob_path(digest)
        actual, _ = hash_file(path)
        if actual != digest:
            self._evict(digest)
            return False
        self._write_stamp(Stamp.of(path, digest))
        return True

    def _read_stamp(self, digest: str) -> Stamp | None:
        with contextlib.suppress(OSError, ValueError, TypeError):
            return Stamp(**json.loads(self._stamp_path(digest).read_text()))
        return None

    def _write_stamp(self, stamp: Stamp) -> None:
        path = self._stamp_path(stamp.digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._atomic_write(path, json.dumps(stamp.__dict__).encode())

    def _evict(self, digest: str) -> None:
        for path in (self.blob_path(digest), self._stamp_path(digest)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def temp_file(self, digest: str) -> Path:
        """A fresh per-process temp path in the cache (same file system as ``blobs/``: rename is atomic)."""
        _, hexdigest = _split(digest)
        return self.root / "tmp" / f"{hexdigest}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"

    def commit(self, temp: Path, digest: str) -> Path:
        """Move verified bytes into place (durably) and stamp them."""
        path = self.blob_path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(temp, path)
        _fsync_dir(path.parent)
        self._write_stamp(Stamp.of(path, digest))
        return path

    def sweep_temps(self) -> list[Path]:
        """Remove temp files of processes that are gone (a killed download); returns what was removed."""
        removed = []
        for temp in (self.root / "tmp").glob("*.part"):
            pid = temp.name.split(".")[1]
            if pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(FileNotFoundError):
                    temp.unlink()
                    removed.append(temp)
        return removed

    @contextlib.contextmanager
    def lock(self, digest: str) -> Iterator[None]:
        _, hexdigest = _split(digest)
        with filelock.FileLock(self.root / "locks" / f"{hexdigest}.lock"):
            yield

    def require_space(self, size: int) -> None:
        free = shutil.disk_usage(self.root).free
        if size + SPARE_BYTES > free:
            raise InsufficientSpace(
                f"{size} bytes to download, {free} free in {self.root} (keeping {SPARE_BYTES} spare)"
            )

    # --- records -----------------------------------------------------------------------

    def write_record(self, key: str, record: dict) -> Path:
        return self.write_json(self.record_path(key), record)

    def read_record(self, key: str) -> dict | None:
        return self.read_json(self.record_path(key))

    def write_json(self, path: Path, document: object) -> Path:
        self._atomic_write(path, json.dumps(document, sort_keys=True).encode())
        return path

    @staticmethod
    def read_json(path: Path) -> dict | None:
        with contextlib.suppress(OSError, ValueError):
            document = json.loads(path.read_bytes())
            return document if isinstance(document, dict) else None
        return None

    def _atomic_write(self, path: Path, data: bytes) -> None:
        temp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        try:
            with open(temp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()

    # --- listing -----------------------------------------------------------------------

    def blobs(self) -> Iterator[tuple[str, Path]]:
        """Every cached blob as (digest, path)."""
        for algo_dir in sorted((self.root / "blobs").glob("*")):
            for path in sorted(algo_dir.iterdir()):
                yield f"{algo_dir.name}:{path.name}", path

    def prune(self, unused_since: float) -> list[str]:
        """Remove blobs last used before ``unused_since`` (epoch seconds) and the records that need them."""
        removed = [digest for digest, path in list(self.blobs()) if path.stat().st_atime < unused_since]
        for digest in removed:
            self._evict(digest)
        gone = set(removed)
        for record in (self.root / "records").glob("*.json"):
            entry = self.read_json(record) or {}
            needed = {b.get("digest") for b in [entry.get("artifact") or {}, *(entry.get("components") or [])]}
            if needed & gone:
                record.unlink(missing_ok=True)
        return removed


def _mark_used(path: Path, stamp: Stamp) -> None:
    """Record a use in the access time (``cache prune`` reads it); the mtime, part of the stamp, stays."""
    with contextlib.suppress(OSError):
        os.utime(path, ns=(time.time_ns(), stamp.mtime_ns))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
