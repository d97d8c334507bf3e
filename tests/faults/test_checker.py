"""The invariant checker catches what it exists to catch (else the fault suite proves nothing)."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import text

from cgstore.core.db import Database
from cgstore.storage import open_storage
from cgstore.storage.hashing import blob_key
from tests.faults.conftest import blob_of, unique_bytes
from tests.support.invariants import violations
from tests.support.services import store_process


def _upload(world, label: str) -> str:
    token = world.token("faults-checker", "acme/*:read,write")
    data = unique_bytes(label)
    with store_process(world.env, world.home) as store:
        answer = httpx.put(
            f"{store.base_url}/v1/repos/acme/checker/blobs/{blob_of(data)}",
            content=data,
            headers={"Authorization": f"Bearer {token}"},
        )
        assert answer.status_code == 201, answer.text
    return blob_of(data)


def test_a_blob_deleted_behind_the_stores_back_is_a_violation(world):
    digest = _upload(world, "checker-planted-loss")
    assert violations(world.settings) == []
    open_storage(world.settings).delete(digest)
    assert violations(world.settings) == [f"{digest}: missing from storage"]
    _forget(world, digest)  # leave the module's world clean for the other tests
    assert violations(world.settings) == []


def test_a_blob_row_whose_bytes_hash_elsewhere_is_a_violation(world):
    digest = _upload(world, "checker-planted-corruption")
    other = unique_bytes("checker-other-bytes")
    storage = open_storage(world.settings)
    storage.delete(digest)
    # Store other bytes of the same length under the digest: a flipped object, same size.
    bucket_client = world.s3.server.client()
    bucket_client.put_object(Bucket=world.s3.bucket, Key=_object_key(storage, digest), Body=other)
    assert violations(world.settings) == [f"{digest}: stored bytes hash to another digest"]
    _forget(world, digest)
    assert violations(world.settings) == []


def _object_key(storage, digest: str) -> str:
    return storage.key(blob_key(digest.removeprefix("blake3:")))


def _forget(world, digest: str) -> None:
    db = Database(world.settings.resolved_database_url)
    with db.session() as session:
        session.execute(text("DELETE FROM repo_blobs WHERE digest = :d"), {"d": digest})
        session.execute(text("DELETE FROM blobs WHERE digest = :d"), {"d": digest})
    db.dispose()


@pytest.mark.torch
def test_a_record_whose_artifact_was_deleted_is_a_violation(world, pt2_archive):
    from tests.compiled_graphs.support import CONSTANTS_A, publication, safetensors_bytes, upload_all
    from tests.support.archives import archive_report

    pub = publication(pt2_archive, archive_report(pt2_archive), components={"consts": safetensors_bytes(CONSTANTS_A)})
    token = world.token("faults-checker", "acme/*:read,write")
    with store_process(world.env, world.home) as store:
        with httpx.Client(base_url=store.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as client:
            upload_all(client, "acme", "checker-record", pub)
            assert client.put(pub.path("acme", "checker-record"), json=pub.manifest).status_code in (200, 201)
    assert violations(world.settings) == []
    storage = open_storage(world.settings)
    saved = b"".join(storage.read(pub.artifact.digest))
    storage.delete(pub.artifact.digest)
    try:
        assert f"{pub.artifact.digest}: missing from storage" in violations(world.settings)
    finally:  # put the bytes back: the other tests of this module share the world
        bucket_client = world.s3.server.client()
        bucket_client.put_object(Bucket=world.s3.bucket, Key=_object_key(storage, pub.artifact.digest), Body=saved)
    assert violations(world.settings) == []
