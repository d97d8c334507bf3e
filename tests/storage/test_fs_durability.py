"""A verified write reaches the disk before it becomes visible (issue 9, class 12).

The filesystem backend's promise: bytes are fsynced before the ``os.replace``
that makes them visible under ``blobs/``, and the directory is fsynced after
it; a staged chunk is fsynced before ``stage_append`` returns (its offset is
recorded only then). A crash-free test cannot see a missing fsync, so these
record the real calls (``os.write``, ``os.fsync``, ``os.replace``, each still
performed) on a real ``FileStorage`` and check their order.
"""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest

from cgstore.storage.fs import FileStorage
from cgstore.storage.hashing import blob_key


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


class CallLog:
    """The file-level calls of the fs backend, in order, as (call, path[, target])."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, ...]] = []
        real_write, real_fsync, real_replace = os.write, os.fsync, os.replace

        def write(fd, data):
            self.calls.append(("write", _fd_path(fd)))
            return real_write(fd, data)

        def fsync(fd):
            self.calls.append(("fsync", _fd_path(fd)))
            return real_fsync(fd)

        def replace(src, dst, **kwargs):
            # Nothing is at the blob's name until this very call.
            assert not Path(dst).exists(), f"{dst} visible before the replace"
            self.calls.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
            return real_replace(src, dst, **kwargs)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def index(self, *call: str) -> int:
        assert call in self.calls, f"{call} never happened: {self.calls}"
        return self.calls.index(call)

    def last(self, *call: str) -> int:
        assert call in self.calls, f"{call} never happened: {self.calls}"
        return len(self.calls) - 1 - self.calls[::-1].index(call)


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture
def storage(tmp_path) -> FileStorage:
    return FileStorage(tmp_path / "store")


def test_blob_write_is_fsynced_before_it_is_renamed_visible(storage, monkeypatch):
    data = os.urandom(3 * 1024 * 1024 + 5)
    digest = digest_of(data)
    final = os.path.realpath(storage.root / blob_key(digest.removeprefix("blake3:")))
    log = CallLog(monkeypatch)
    with storage.writer(digest, len(data)) as writer:
        for start in range(0, len(data), 1 << 20):
            writer.write(data[start : start + (1 << 20)])
        writer.commit()
    replaces = [call for call in log.calls if call[0] == "replace"]
    assert len(replaces) == 1 and replaces[0][2] == final
    temp = replaces[0][1]
    renamed = log.index(*replaces[0])
    assert log.last("write", temp) < log.index("fsync", temp) < renamed
    assert log.index("fsync", os.path.dirname(final)) > renamed  # the rename itself made durable
    assert b"".join(storage.read(digest)) == data


def test_staged_upload_is_fsynced_per_chunk_and_before_commit_renames_it(storage, monkeypatch):
    first, second = os.urandom(100_000), os.urandom(50_000)
    digest = digest_of(first + second)
    staged = storage.stage_begin("s" * 32)
    staging = os.path.realpath(storage.uploads_dir / ("s" * 32))
    log = CallLog(monkeypatch)
    staged = storage.stage_append(staged, iter([first]))
    # The chunk is durable before stage_append returns: its offset is recorded next.
    assert log.calls[-1] == ("fsync", staging)
    staged = storage.stage_append(staged, iter([second]))
    assert log.calls[-1] == ("fsync", staging)
    chunks_done = len(log.calls)
    assert storage.stage_commit(staged, digest) == len(first) + len(second)
    final = os.path.realpath(storage.root / blob_key(digest.removeprefix("blake3:")))
    renamed = log.index("replace", staging, final)
    assert chunks_done <= log.last("fsync", staging) < renamed  # fsynced again after the dead tail is cut
    assert log.index("fsync", os.path.dirname(final)) > renamed
    assert b"".join(storage.read(digest)) == first + second
