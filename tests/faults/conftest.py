"""The fault suite's world: a store process on a private PostgreSQL and a stoppable S3.

Each test module gets its own cluster and bucket, so stopping them disturbs no
other test; each test starts (and may kill) its own store processes on them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cgstore.settings import Settings
from tests.support.faults import PrivatePostgres, StoppableS3, private_postgres, stoppable_s3
from tests.support.invariants import violations
from tests.support.services import REPO_ROOT, use_s3_credentials


@dataclass
class FaultWorld:
    pg: PrivatePostgres
    s3: StoppableS3
    home: Path
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {
            "CGSTORE_DATABASE_URL": self.pg.url,
            "CGSTORE_STORAGE_URL": self.s3.storage_url,
            "CGSTORE_REDIRECT_DOWNLOADS": "false",
            **self.s3.server.credentials,
        }

    @property
    def settings(self) -> Settings:
        return Settings(home=self.home, database_url=self.pg.url, storage_url=self.s3.storage_url)

    def token(self, sub: str, grant: str) -> str:
        """A token minted by the CLI against this world's database and signing key."""
        if (sub, grant) not in self.tokens:
            env = {**os.environ, **self.env, "CGSTORE_HOME": str(self.home)}
            cli = [sys.executable, "-m", "cgstore.cli"]
            subprocess.run([*cli, "db", "upgrade"], env=env, check=True, cwd=REPO_ROOT, capture_output=True)
            minted = subprocess.run(
                [*cli, "token", "mint", "--sub", sub, "--grant", grant, "--ttl", "2h"],
                env=env,
                check=True,
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
            )
            self.tokens[(sub, grant)] = minted.stdout.strip()
        return self.tokens[(sub, grant)]

    def assert_invariants(self) -> None:
        assert violations(self.settings) == []


@pytest.fixture(scope="module")
def world(s3_server, tmp_path_factory) -> Iterator[FaultWorld]:
    use_s3_credentials(s3_server)  # the checker reads the bucket from this process
    with private_postgres() as pg, stoppable_s3(s3_server) as s3:
        yield FaultWorld(pg, s3, tmp_path_factory.mktemp("faults-home"))


def blob_of(data: bytes) -> str:
    """The protocol digest (blake3) of ``data``; hashlib is only used for unique payloads."""
    import blake3

    return f"blake3:{blake3.blake3(data).hexdigest()}"


def unique_bytes(label: str, size: int = 4096) -> bytes:
    seed = hashlib.sha256(label.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]
