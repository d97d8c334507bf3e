"""Issue 9, class 10: what an error tells, and who may read the store's files.

- A 503 from a failing disk says what failed (the operation, the errno), never
  where on disk.
- ``CGSTORE_HOME`` and everything ``cgstore`` creates under it is private:
  directories 0700, files 0600 (checked on ``cgstore serve`` itself, and on the
  directory backend alone under a permissive umask).
- A ``Range`` echoed in an error is cut to a bounded length.
- Two ``Authorization`` headers are a 400, not "the first wins".
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import httpx

from cgstore.core.http import MAX_ECHO_CHARS
from cgstore.storage import StagedUpload
from cgstore.storage.fs import FileStorage
from tests.blobs.test_blobs_api import digest_of
from tests.support.live_store import unique_repo
from tests.support.services import REPO_ROOT, store_process


def _modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and of every entry under it, by relative path."""
    modes = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        modes[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return modes


def _assert_private(root: Path) -> None:
    modes = _modes(root)
    wrong = {name: oct(mode) for name, mode in modes.items() if mode != (0o700 if (root / name).is_dir() else 0o600)}
    assert not wrong, wrong


def _assert_no_path(body: dict, *paths: Path) -> None:
    text = repr(body)
    for path in paths:
        assert str(path) not in text, body
    assert "/" not in body["error"]["message"] and "/" not in repr(body["error"]["detail"]), body


def test_storage_errors_say_what_failed_not_where(make_store):
    live = make_store("embedded")
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write")
    root = live.context.storage.root
    data = b"where is this?"
    with live.client(token) as client:
        shutil.rmtree(root / "tmp")
        put = client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}", content=data)
        shutil.rmtree(root / "uploads")
        opened = client.post(f"/v1/repos/acme/{name}/uploads")
        ready = client.get("/readyz")
    for answer in (put, opened):
        assert answer.status_code == 503, answer.text
        body = answer.json()
        assert body["error"]["code"] == "UNAVAILABLE"
        assert body["error"]["message"].startswith("storage failed: ")
        assert body["error"]["detail"]["cause"].startswith("ENOENT")
        _assert_no_path(body, root, live.settings.home)
    assert ready.status_code == 503 and str(root) not in ready.text


def test_cgstore_serve_keeps_its_home_private(tmp_path):
    home = tmp_path / "fresh" / "home"
    with store_process({}, home) as served:
        token = subprocess.run(
            [sys.executable, "-m", "cgstore.cli", "token", "mint", "--sub", "alice", "--grant", "acme/*:read,write"],
            env=served.env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        data = os.urandom(4096)
        with httpx.Client(base_url=served.base_url, headers={"Authorization": f"Bearer {token}"}) as client:
            assert client.put(f"/v1/repos/acme/private/blobs/{digest_of(data)}", content=data).status_code == 201
            location = client.post("/v1/repos/acme/private/uploads").headers["location"]
            assert client.patch(location, content=data, headers={"Content-Range": "0-4095"}).status_code == 202
        _assert_private(home)
    # The database, its journal, the signing key, a blob and a staged upload were all there.
    names = set(_modes(home))
    assert {"cgstore.sqlite3", "token-signing-key.pem", "blobs/uploads"} <= names
    assert any(name.startswith("blobs/blobs/") and name.count("/") == 3 for name in names)


def test_directory_backend_creates_private_files_whatever_the_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        storage = FileStorage(tmp_path / "root" / "store")
        data = b"private bytes"
        with storage.writer(digest_of(data), len(data)) as writer:
            writer.write(data)
            writer.commit()
        staged = storage.stage_begin("session1")
        storage.stage_append(StagedUpload(staged.session_id, 0, staged.state), iter([data]))
    finally:
        os.umask(previous)
    _assert_private(tmp_path / "root" / "store")


def test_a_range_echoed_in_an_error_is_cut(make_store):
    # Parsing does not differ between configurations (test_hardening_ranges runs both).
    live = make_store("embedded")
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write")
    data = b"0123456789"
    long_range = "bytes=" + "1-2," * 500 + "3-4"
    with live.client(token) as client:
        client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}", content=data)
        answer = client.get(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}", headers={"Range": long_range})
    assert answer.status_code == 416
    assert answer.json()["error"]["detail"]["range"] == long_range[:MAX_ECHO_CHARS]


def test_two_authorization_headers_are_a_bad_request(store):
    name = unique_repo()
    reader = store.mint("alice", f"acme/{name}:read")
    writer = store.mint("mallory", f"acme/{name}:read,write")
    data = b"who is asking?"
    headers = [("Authorization", f"Bearer {reader}"), ("Authorization", f"Bearer {writer}")]
    with httpx.Client(base_url=store.base_url) as client:
        answer = client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}", content=data, headers=headers)
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "BAD_REQUEST"
        assert client.get(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}", headers=headers).status_code == 400
