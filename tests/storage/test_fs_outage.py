"""The filesystem backend failing: a full disk, a read-only disk (issue 9, class 12).

Outages were tested with S3 cut and with the database cut, never with the
directory backend's disk failing. Here the store's blobs live on a real 1 MiB
tmpfs that is filled or remounted read-only under a running store, with
SQLite and with PostgreSQL as its database. Every write then answers 503
``UNAVAILABLE`` with ``Retry-After``, and leaves nothing half-written: no blob
row, no visible object, no temp file, no session row, no repo, staging at its
committed offset. Mounting needs root (the suite's machines run it as root);
without it the read-only case falls back to directory permissions.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import blake3
import pytest
from sqlalchemy import func, select

from cgstore.blobs.models import Blob, UploadSession
from cgstore.repos.models import Repo
from tests.support.leftovers import leftover_writes, staged_session_bytes
from tests.support.live_store import unique_repo

DISK_BYTES = 1 << 20
MOUNTABLE = os.geteuid() == 0


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


class SmallDisk:
    """A 1 MiB filesystem of its own (tmpfs), or a plain directory when not root."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        if MOUNTABLE:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES},mode=0700", "tmpfs", str(path)], check=True
            )

    def make_read_only(self) -> None:
        if MOUNTABLE:  # root ignores permissions; a read-only mount stops it too
            subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)
        else:
            for directory in [self.path, *[p for p in self.path.rglob("*") if p.is_dir()]]:
                directory.chmod(0o500)

    def close(self) -> None:
        if MOUNTABLE:
            subprocess.run(["umount", "-l", str(self.path)], check=True)
        else:
            for directory in [self.path, *[p for p in self.path.rglob("*") if p.is_dir()]]:
                directory.chmod(0o700)


@pytest.fixture
def disk(tmp_path):
    small = SmallDisk(tmp_path / "disk")
    yield small
    small.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def fs_store(request, make_store, disk):
    """A store whose blobs live on ``disk``, with either database."""
    overrides = {"storage_url": str(disk.path / "blobs")}
    if request.param == "postgresql":
        overrides["database_url"] = request.getfixturevalue("pg_url")
    return make_store("embedded", **overrides)


def rows(store, model, *where) -> int:
    with store.context.db.session() as session:
        return session.scalar(select(func.count()).select_from(model).where(*where))


def assert_unavailable(response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "UNAVAILABLE"
    assert int(response.headers["retry-after"]) > 0


def assert_nothing_of(store, name: str, digest: str) -> None:
    assert rows(store, Blob, Blob.digest == digest) == 0
    assert store.context.storage.size(digest) is None
    assert not leftover_writes(store.context.storage)


@pytest.mark.skipif(not MOUNTABLE, reason="a full disk needs a tmpfs of its own (mount needs root)")
def test_full_disk_is_503_and_nothing_half_written(fs_store):
    name = unique_repo()
    token = fs_store.mint("alice", f"acme/{name}:read,write")
    too_big = os.urandom(2 * DISK_BYTES)
    with fs_store.client(token) as client:
        put = client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(too_big)}", content=too_big)
        assert_unavailable(put)
        assert_nothing_of(fs_store, name, digest_of(too_big))
        assert rows(fs_store, Repo, Repo.owner == "acme", Repo.name == name) == 0
        # A resumable upload: a small chunk lands, then a chunk the disk cannot hold.
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        session_id = location.rsplit("/", 1)[1]
        first = os.urandom(1000)
        assert client.patch(location, content=first, headers={"Content-Range": "0-999"}).status_code == 202
        huge = client.patch(location, content=too_big, headers={"Content-Range": f"1000-{1000 + len(too_big) - 1}"})
        assert_unavailable(huge)
        assert staged_session_bytes(fs_store.context.storage, session_id) == len(first)
        assert client.get(location).headers["upload-offset"] == str(len(first))
        # The disk was never left full: the same session carries on and commits.
        commit = client.put(location, params={"digest": digest_of(first)})
        assert commit.status_code == 201, commit.text
        assert client.get(f"/v1/repos/acme/{name}/blobs/{digest_of(first)}").content == first


def test_read_only_disk_is_503_and_nothing_half_written(fs_store, disk):
    name = unique_repo()
    token = fs_store.mint("alice", f"acme/{name}:read,write")
    kept = os.urandom(5000)
    with fs_store.client(token) as client:
        assert client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(kept)}", content=kept).status_code == 201
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        session_id = location.rsplit("/", 1)[1]
        assert client.patch(location, content=b"s" * 100, headers={"Content-Range": "0-99"}).status_code == 202
        disk.make_read_only()

        lost = os.urandom(20_000)
        assert_unavailable(client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(lost)}", content=lost))
        assert_nothing_of(fs_store, name, digest_of(lost))

        sessions_before = rows(fs_store, UploadSession)
        assert_unavailable(client.post(f"/v1/repos/acme/{name}/uploads"))
        assert rows(fs_store, UploadSession) == sessions_before

        assert_unavailable(client.patch(location, content=b"t" * 100, headers={"Content-Range": "100-199"}))
        assert client.get(location).headers["upload-offset"] == "100"
        assert staged_session_bytes(fs_store.context.storage, session_id) == 100

        other = unique_repo()
        writer = fs_store.mint("alice", f"acme/{other}:read,write")
        with fs_store.client(writer) as other_client:
            assert_unavailable(other_client.post(f"/v1/repos/acme/{other}/uploads"))
            assert_unavailable(other_client.put(f"/v1/repos/acme/{other}/blobs/{digest_of(lost)}", content=lost))
        assert rows(fs_store, Repo, Repo.owner == "acme", Repo.name == other) == 0

        # What was stored before still reads.
        assert client.get(f"/v1/repos/acme/{name}/blobs/{digest_of(kept)}").content == kept
