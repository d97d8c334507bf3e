"""Storage backends under test, and a look at what they left behind.

``storage_case`` runs a test once per backend: ``fs`` (a directory in
``tmp_path``, opened from a ``file://`` URL) and ``s3`` (a fresh bucket, under a
key prefix, on the session's real S3 — Ceph's RADOS Gateway — reached over HTTP). Both
are built from ``Settings`` the way the app builds them. S3 runs with the
smallest legal part size (5 MiB) so that multipart paths are cheap to reach.

``StorageCase.keys(area)`` lists what is stored under ``blobs``, ``uploads`` or
``tmp`` (relative keys, identical layout on both backends), and
``pending_multipart()`` lists open S3 multipart uploads: together they say
whether an operation left anything behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from cgstore.settings import MiB, Settings
from cgstore.storage import Storage, open_storage
from cgstore.storage.fs import FileStorage
from cgstore.storage.s3 import S3Storage
from tests.support.services import S3Server, use_s3_credentials

BACKENDS = ("fs", "s3")
S3_TEST_PART_BYTES = 5 * MiB
S3_TEST_CONCURRENCY = 3
S3_TEST_PREFIX = "cg/test"


@dataclass
class StorageCase:
    kind: str
    storage: Storage
    settings: Settings
    s3: S3Server | None = None
    bucket: str | None = None

    def keys(self, area: str) -> list[str]:
        """Relative keys stored under ``area`` (``blobs``, ``uploads``, ``tmp``), sorted."""
        if isinstance(self.storage, FileStorage):
            root = self.storage.root
            return sorted(str(p.relative_to(root)) for p in (root / area).rglob("*") if p.is_file())
        assert isinstance(self.storage, S3Storage)
        prefix = self.storage.key(f"{area}/")
        paginator = self.storage.client.get_paginator("list_objects_v2")
        found = []
        for page in paginator.paginate(Bucket=self.storage.bucket, Prefix=prefix):
            found += [item["Key"].removeprefix(self.storage.prefix) for item in page.get("Contents", [])]
        return sorted(found)

    def pending_multipart(self) -> list[str]:
        """Keys of open multipart uploads (always empty for fs)."""
        if not isinstance(self.storage, S3Storage):
            return []
        listed = self.storage.client.list_multipart_uploads(Bucket=self.storage.bucket)
        return sorted(upload["Key"] for upload in listed.get("Uploads", []))

    def leftovers(self) -> dict[str, list[str]]:
        """Everything that is not a committed blob; a clean store answers all-empty."""
        return {"uploads": self.keys("uploads"), "tmp": self.keys("tmp"), "multipart": self.pending_multipart()}


def build_storage_case(kind: str, tmp_path: Path, s3: S3Server | None, **overrides) -> StorageCase:
    """A storage of ``kind`` built through ``open_storage(Settings(...))``."""
    if kind == "fs":
        settings = Settings(home=tmp_path / "home", storage_url=(tmp_path / "store").as_uri(), **overrides)
        return StorageCase(kind, open_storage(settings), settings)
    assert s3 is not None
    use_s3_credentials(s3)
    bucket = s3.create_bucket()
    options = {"s3_part_bytes": S3_TEST_PART_BYTES, "s3_max_concurrency": S3_TEST_CONCURRENCY, **overrides}
    url = f"s3://{bucket}/{S3_TEST_PREFIX}?endpoint_url={s3.endpoint_url}&region={s3.region}"
    settings = Settings(home=tmp_path / "home", storage_url=url, **options)
    return StorageCase(kind, open_storage(settings), settings, s3=s3, bucket=bucket)


@pytest.fixture(params=BACKENDS)
def make_storage_case(request, tmp_path) -> Callable[..., StorageCase]:
    """``make_storage_case(**settings_overrides)`` for the parametrized backend."""
    kind = request.param
    s3 = request.getfixturevalue("s3_server") if kind == "s3" else None
    counter = iter(range(1_000_000))

    def make(**overrides) -> StorageCase:
        return build_storage_case(kind, tmp_path / f"case{next(counter)}", s3, **overrides)

    return make


@pytest.fixture
def storage_case(make_storage_case) -> StorageCase:
    """One backend under test (the test runs once per backend)."""
    return make_storage_case()
