"""Seeding for the GC tests: a registry of its own, and blobs written in bulk with link times in the past."""

from __future__ import annotations

import datetime as dt
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import blake3
import pytest
from sqlalchemy import func, insert, select

from cgstore.blobs.models import Blob, RepoBlob
from cgstore.core.db import utcnow
from cgstore.repos.models import Repo
from cgstore.storage.fs import FileStorage
from cgstore.storage.hashing import blob_key
from tests.support.live_store import CONFIGURATIONS, LiveStore, unique_repo

NOW = utcnow()
OLD = NOW - dt.timedelta(days=2)
RECENT = NOW - dt.timedelta(hours=1)
GRACE_S = 24 * 3600


@pytest.fixture(params=CONFIGURATIONS)
def registry(request, make_registry) -> LiveStore:
    """A store on a registry no other test shares."""
    return make_registry(request.param)


# -- seeding ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Seeded:
    digest: str
    data: bytes


def make_blobs(count: int, tag: str) -> list[Seeded]:
    blobs = []
    for i in range(count):
        data = f"{tag}-{i}".encode()
        blobs.append(Seeded("blake3:" + blake3.blake3(data).hexdigest(), data))
    return blobs


def write_objects(live: LiveStore, blobs: list[Seeded]) -> None:
    """Small objects straight into the backend, in parallel on S3."""
    storage = live.context.storage
    if isinstance(storage, FileStorage):
        for blob in blobs:
            path = storage.root / blob_key(blob.digest.removeprefix("blake3:"))
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(blob.data)
        return

    def put(blob: Seeded) -> None:
        storage.client.put_object(Bucket=storage.bucket, Key=storage.blob_key(blob.digest), Body=blob.data)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, blobs))


def stored_digests(live: LiveStore) -> set[str]:
    """Every blob object in the backend, as digests."""
    storage = live.context.storage
    if isinstance(storage, FileStorage):
        return {"blake3:" + path.name for path in (storage.root / "blobs").rglob("*") if path.is_file()}
    found = set()
    paginator = storage.client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=storage.bucket, Prefix=storage.key("blobs/")):
        found |= {"blake3:" + item["Key"].rsplit("/", 1)[-1] for item in page.get("Contents", [])}
    return found


def make_repo(live: LiveStore) -> int:
    with live.context.db.session() as session:
        session.execute(
            insert(Repo).values(owner="gc", name=unique_repo(), visibility="owner", created_by="t", created_at=OLD)
        )
        return session.scalar(select(func.max(Repo.id)))


def seed_rows(
    live: LiveStore,
    blobs: list[Seeded],
    linked_at: dt.datetime,
    repo_id: int | None = None,
    link_created_at: dt.datetime | None = None,
) -> None:
    rows = [{"digest": b.digest, "size": len(b.data), "created_at": OLD, "linked_at": linked_at} for b in blobs]
    with live.context.db.session() as session:
        session.execute(insert(Blob), rows)
        if repo_id is not None:
            links = [
                {"repo_id": repo_id, "digest": b.digest, "linked_by": "t", "created_at": link_created_at} for b in blobs
            ]
            session.execute(insert(RepoBlob), links)


def blob_rows(live: LiveStore) -> set[str]:
    with live.context.db.session() as session:
        return set(session.scalars(select(Blob.digest)))


def seed_records(live: LiveStore, repo_id: int, artifacts: list[str], yanked_at: dt.datetime | None = None) -> None:
    """One record row per artifact digest, in bulk (the columns GC reads are the real ones)."""
    from cgstore.compiled_graphs.models import CompiledGraph

    rows = [
        {
            "repo_id": repo_id,
            "key": f"ck1-{digest[7:63]}",
            "kind": "aot-inductor",
            "format": "pt2",
            "family": "f",
            "lane": "a+b",
            "sm": "sm_90",
            "graph_digest": digest,
            "envelope": {},
            "envelope_digest": digest,
            "toolchain": {},
            "toolchain_digest": digest,
            "recorded_versions": {},
            "artifact_digest": digest,
            "artifact_size": 1,
            "component_set": digest,
            "input_contract": {},
            "binding_table": [],
            "publisher": "t",
            "created_at": OLD,
            "yanked_at": yanked_at,
            "health": "ok",
        }
        for digest in artifacts
    ]
    with live.context.db.session() as session:
        session.execute(insert(CompiledGraph), rows)
