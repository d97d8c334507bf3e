"""Fixtures of the operations tests: replicas of one registry (one PostgreSQL, one bucket)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from cgstore.settings import Settings
from tests.support.live_store import LiveStore, running_store
from tests.support.services import postgres_database, use_s3_credentials


@pytest.fixture
def replica_settings(s3_server, tmp_path) -> Iterator[Callable[..., Settings]]:
    """Settings for one more replica of a registry: shared database, bucket and signing key.

    Each replica has its own home (nothing else is shared), as on separate hosts.
    The registry gets a database of its own: blobs are stored once per database,
    so a session database whose rows name bytes in other buckets would make
    this bucket miss them.
    """
    use_s3_credentials(s3_server)
    bucket = s3_server.create_bucket()
    key = tmp_path / "shared-signing-key.pem"
    counter = iter(range(1000))

    def make(**overrides) -> Settings:
        overrides.setdefault("reaper_interval_s", 3600)
        return Settings(
            home=tmp_path / f"replica-{next(counter)}",
            database_url=pg_url,
            storage_url=s3_server.storage_url(bucket),
            token_signing_key=key,
            **overrides,
        )

    make.bucket = bucket
    with postgres_database("cgstore_replicas") as pg_url:
        yield make


@pytest.fixture
def replicas(replica_settings) -> tuple[LiveStore, LiveStore]:
    """Two running store instances of one registry."""
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(running_store(replica_settings(), "replica-a"))
        second = stack.enter_context(running_store(replica_settings(), "replica-b"))
        yield first, second


# -- a registry of its own, for GC (tests/operations/gc_support.py) --------------------------------
from tests.operations.gc_support import registry  # noqa: E402, F401
