"""The invariant checker catches what it exists to catch (else the fault suite proves nothing)."""

from __future__ import annotations

import httpx
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
            content=data, headers={"Authorization": f"Bearer {token}"},
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
