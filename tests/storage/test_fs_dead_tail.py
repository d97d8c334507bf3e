"""The directory backend's in-place commit cuts a dead tail: the stored blob is exactly its bytes.

A session's staging file keeps, past its last recorded extent, the bytes of an
append that was never recorded (here: the store was killed between staging a
chunk and moving the session's offset, ``CGSTORE_CRASH_AT=session.staged``).
The live extents are still contiguous from byte 0, so the commit renames the
file itself into ``blobs/``: it must cut that tail first, or the blob under
the digest's name holds more bytes than the digest's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import blake3
import httpx
import pytest

from cgstore.settings import Settings
from cgstore.storage import open_storage
from tests.storage.test_storage import assert_stored_once
from tests.support.services import REPO_ROOT, store_process
from tests.support.storage_fixtures import StorageCase

pytestmark = pytest.mark.slow


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def _token(home, grant: str) -> str:
    env = {**os.environ, "CGSTORE_HOME": str(home)}
    cli = [sys.executable, "-m", "cgstore.cli"]
    subprocess.run([*cli, "db", "upgrade"], env=env, check=True, cwd=REPO_ROOT, capture_output=True)
    minted = subprocess.run(
        [*cli, "token", "mint", "--sub", "alice", "--grant", grant, "--ttl", "1h"],
        env=env,
        check=True,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    return minted.stdout.strip()


def _client(store, token: str) -> httpx.Client:
    return httpx.Client(base_url=store.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def test_commit_in_place_after_a_crashed_last_append_stores_exactly_the_digests_bytes(tmp_path):
    home = tmp_path / "home"  # the embedded configuration: SQLite and a directory under it
    token = _token(home, "acme/*:read,write")
    head, crashed = os.urandom(8192), os.urandom(5000)
    with store_process({}, home) as store, _client(store, token) as client:
        location = client.post("/v1/repos/acme/dead-tail/uploads").headers["Location"]
        assert client.patch(location, content=head, headers={"Content-Range": "0-8191"}).status_code == 202
    with store_process({"CGSTORE_CRASH_AT": "session.staged"}, home) as store, _client(store, token) as client:
        with pytest.raises(httpx.TransportError):
            client.patch(location, content=crashed, headers={"Content-Range": "8192-13191"})
        assert store.process.wait(15) == -signal.SIGKILL
    settings = Settings(home=home)
    case = StorageCase("fs", open_storage(settings), settings)
    staging = case.storage.uploads_dir / location.rsplit("/", 1)[1]
    assert staging.stat().st_size == len(head) + len(crashed)  # the dead tail is there
    with store_process({}, home) as store, _client(store, token) as client:
        assert client.get(location).headers["Upload-Offset"] == "8192"
        committed = client.put(location, params={"digest": digest_of(head)})
        assert committed.status_code == 201, committed.text
        assert client.get(f"/v1/repos/acme/dead-tail/blobs/{digest_of(head)}").content == head
    assert_stored_once(case, head)
