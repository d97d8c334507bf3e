"""A repo comes into being only with a successful write (issue 9, class 7).

Checking a write grant used to create the repo, so a PUT with a wrong digest,
a refused mount, an upload-session call through another repo and a
``blobs:missing`` query each left a repo behind. Observed in the repos table,
on both configurations.
"""

from __future__ import annotations

import os

import blake3
import pytest
from sqlalchemy import select

from cgstore.repos.models import Repo
from tests.support.live_store import unique_repo


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def repo_exists(store, name: str) -> bool:
    with store.context.db.session() as session:
        return session.scalar(select(Repo.id).where(Repo.owner == "acme", Repo.name == name)) is not None


@pytest.fixture
def fresh(store):
    """A repo name nobody has written yet, and a read/write token for it."""
    name = unique_repo("fresh")
    return name, store.mint("alice", f"acme/{name}:read,write")


def test_put_with_a_wrong_digest_creates_no_repo(store, fresh):
    name, token = fresh
    data = os.urandom(4096)
    with store.client(token) as client:
        wrong = client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(b'other')}", content=data)
        assert wrong.status_code == 400
        assert not repo_exists(store, name)
        # The same write with the right digest is what creates it.
        assert client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}", content=data).status_code == 201
    assert repo_exists(store, name)


def test_refused_mount_creates_no_repo(store, fresh):
    name, token = fresh
    source = unique_repo("src")
    data = os.urandom(1000)
    digest = digest_of(data)
    owner_token = store.mint("bob", f"acme/{source}:read,write")
    with store.client(owner_token) as client:
        assert client.put(f"/v1/repos/acme/{source}/blobs/{digest}", content=data).status_code == 201
    with store.client(token) as client:
        # alice cannot read the source: refused like a missing blob.
        unreadable = client.post(f"/v1/repos/acme/{name}/blobs/{digest}:mount", params={"from": f"acme/{source}"})
        assert unreadable.status_code == 404
        # A source that does not exist, and a blob the source does not have.
        nowhere = client.post(f"/v1/repos/acme/{name}/blobs/{digest}:mount", params={"from": f"acme/{name}-x"})
        assert nowhere.status_code == 404
    assert not repo_exists(store, name)
    reader = store.mint("alice", f"acme/{name}:read,write", f"acme/{source}:read")
    with store.client(reader) as client:
        absent = client.post(
            f"/v1/repos/acme/{name}/blobs/{digest_of(b'absent')}:mount", params={"from": f"acme/{source}"}
        )
        assert absent.status_code == 404
        assert not repo_exists(store, name)
        mounted = client.post(f"/v1/repos/acme/{name}/blobs/{digest}:mount", params={"from": f"acme/{source}"})
        assert mounted.status_code == 201
    assert repo_exists(store, name)


def test_upload_session_call_through_another_repo_creates_no_repo(store, fresh):
    name, _ = fresh
    other = unique_repo("other")
    token = store.mint("alice", f"acme/{name}:read,write", f"acme/{other}:read,write")
    with store.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        session_id = location.rsplit("/", 1)[1]
        through_other = f"/v1/repos/acme/{other}/uploads/{session_id}"
        for method in ("GET", "PATCH", "PUT", "DELETE"):
            response = client.request(
                method,
                through_other,
                params={"digest": digest_of(b"x")},
                content=b"x",
                headers={"Content-Range": "0-0"},
            )
            assert response.status_code == 404 and response.json()["error"]["code"] == "BLOB_UPLOAD_UNKNOWN"
    assert not repo_exists(store, other)


def test_missing_query_creates_no_repo(store, fresh):
    name, token = fresh
    with store.client(token) as client:
        answer = client.post(f"/v1/repos/acme/{name}/blobs:missing", json={"digests": [digest_of(b"a")]})
    assert answer.status_code == 200 and answer.json() == {"missing": [digest_of(b"a")]}
    assert not repo_exists(store, name)
