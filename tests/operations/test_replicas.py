"""Two store instances on one PostgreSQL and one bucket behave as one registry."""

from __future__ import annotations

import os
import threading

import blake3
import pytest
from sqlalchemy import func, select

from cgstore.blobs.models import Blob, RepoBlob
from cgstore.compiled_graphs.models import CompiledGraph
from cgstore.repos.models import Repo
from tests.compiled_graphs.support import CONSTANTS_A, publication, safetensors_bytes, upload_all
from tests.support.archives import archive_report
from tests.support.live_store import unique_repo


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def objects_under(store, prefix: str) -> list[str]:
    storage = store.context.storage
    listed = storage.client.list_objects_v2(Bucket=storage.bucket, Prefix=storage.key(prefix))
    return [item["Key"] for item in listed.get("Contents", [])]


def open_multipart(store) -> list[dict]:
    storage = store.context.storage
    return storage.client.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", [])


@pytest.mark.parametrize("size", [3 << 20, 24 << 20], ids=["small", "parts"])
def test_a_session_begun_on_one_replica_is_continued_and_committed_on_the_other(replicas, size):
    """With 12 MiB chunks the session's bytes are parts of its multipart upload on S3: the
    replica that commits never hashed the first one, so it must read the result back."""
    first, second = replicas
    name = unique_repo()
    token = first.mint("alice", f"acme/{name}:read,write")
    data = os.urandom(size)
    digest = digest_of(data)
    half = len(data) // 2
    with first.client(token) as a, second.client(token, follow_redirects=True) as b:
        opened = a.post(f"/v1/repos/acme/{name}/uploads")
        assert opened.status_code == 202
        location = opened.headers["location"]
        assert a.patch(location, content=data[:half], headers={"Content-Range": f"0-{half - 1}"}).status_code == 202
        status = b.get(location)
        assert status.status_code == 204 and status.headers["upload-offset"] == str(half)
        chunk = b.patch(location, content=data[half:], headers={"Content-Range": f"{half}-{len(data) - 1}"})
        assert chunk.status_code == 202, chunk.text
        committed = b.put(location, params={"digest": digest})
        assert committed.status_code == 201, committed.text
        # Either replica now serves it, and the session is gone on both.
        assert b.get(f"/v1/repos/acme/{name}/blobs/{digest}").content == data
        assert a.head(f"/v1/repos/acme/{name}/blobs/{digest}").status_code == 200
        assert a.get(location).status_code == 404
    assert objects_under(first, "uploads/") == []


def test_concurrent_uploads_of_one_blob_through_both_replicas_store_one_object(replicas):
    first, second = replicas
    name = unique_repo()
    token = first.mint("alice", f"acme/{name}:read,write")
    data = os.urandom(6 << 20)  # multipart on S3 (above the 5 MiB part minimum)
    digest = digest_of(data)
    barrier = threading.Barrier(4)
    answers = []

    def put(replica) -> None:
        with replica.client(token) as client:
            barrier.wait()
            answers.append(client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data).status_code)

    threads = [threading.Thread(target=put, args=(replica,)) for replica in (first, second, first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == [201] * 4
    hex_digest = digest.removeprefix("blake3:")
    assert len([key for key in objects_under(first, "blobs/") if hex_digest in key]) == 1
    assert open_multipart(first) == []
    with first.context.db.session() as session:
        assert session.scalar(select(func.count()).select_from(Blob).where(Blob.digest == digest)) == 1
        assert session.scalar(select(func.count()).select_from(RepoBlob).where(RepoBlob.digest == digest)) == 1
    assert first.context.storage.size(digest) == len(data)


def test_concurrent_publishes_of_one_key_through_both_replicas_give_one_record(replicas, pt2_archive):
    first, second = replicas
    name = unique_repo()
    token = first.mint("minter", f"acme/{name}:read,write")
    pub = publication(pt2_archive, archive_report(pt2_archive), components={"consts": safetensors_bytes(CONSTANTS_A)})
    with second.client(token) as client:
        upload_all(client, "acme", name, pub)
    barrier = threading.Barrier(6)
    answers = []

    def put(replica) -> None:
        with replica.client(token) as client:
            barrier.wait()
            answers.append(client.put(pub.path("acme", name), json=pub.manifest).status_code)

    threads = [threading.Thread(target=put, args=(replica,)) for replica in (first, second) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(answers) == [200] * 5 + [201]  # one created, five idempotent "exists"
    with first.context.db.session() as session:
        keys = session.scalars(
            select(CompiledGraph.key).join(Repo, Repo.id == CompiledGraph.repo_id).where(Repo.name == name)
        ).all()
    assert keys == [pub.key]
