"""Typed settings of the store, read from ``CGSTORE_*`` environment variables.

Every option is listed in the README's "Configuration" table. The defaults are
the embedded configuration: SQLite and a local directory under ``CGSTORE_HOME``
and an Ed25519 signing key generated there on first use, so ``cgstore serve``
needs no configuration at all.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1 << 20
GiB = 1 << 30


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CGSTORE_", extra="ignore")

    home: Path = Field(Path(".cgstore"), description="State directory of the embedded default.")
    host: str = "127.0.0.1"
    port: int = 8080
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; default sqlite under CGSTORE_HOME."
    )
    storage_url: str | None = Field(
        None,
        description="A directory path or file:// URL, or s3://bucket?endpoint_url=…&region=…; "
        "default a directory under CGSTORE_HOME.",
    )
    s3_public_endpoint_url: str | None = Field(
        None, description="Endpoint written into presigned URLs, when clients reach S3 by another name."
    )
    token_signing_key: Path | None = Field(
        None, description="Ed25519 private key (PEM); default CGSTORE_HOME/token-signing-key.pem, generated once."
    )
    token_keys_dir: Path | None = Field(
        None,
        description="Directory of the private keys `cgstore keys rotate` adds (<kid>.pem, 0600); "
        "default CGSTORE_HOME/keys.",
    )
    token_issuer: str = "cgstore"
    redirect_downloads: bool = Field(True, description="Answer blob GETs on S3 with 307 to a presigned URL.")
    presign_ttl_s: int = Field(300, ge=10, le=7 * 24 * 3600)
    max_blob_bytes: int = Field(64 * GiB, ge=1)
    max_json_bytes: int = Field(1 * MiB, ge=1024, description="Largest JSON request body accepted.")
    upload_session_ttl_s: int = Field(24 * 3600, ge=1, description="Idle time after which an upload session expires.")
    reaper_interval_s: float = Field(60.0, gt=0, description="How often expired upload sessions are reclaimed.")
    gc_interval_s: float = Field(3600.0, gt=0, description="How often the server collects garbage.")
    gc_grace_s: int = Field(
        24 * 3600, ge=0, description="Blobs linked more recently than this (and yanked records younger) are kept."
    )
    gc_batch_size: int = Field(500, ge=1, le=10_000, description="Blobs condemned and deleted per GC batch.")
    scrub_interval_s: float = Field(
        0.0, ge=0, description="How often the server scrubs the next batch of blobs (0: never; `cgstore scrub` only)."
    )
    lease_ttl_s: float = Field(
        120.0, gt=0, description="Lifetime of a background task's lease; a crashed holder's lapses after this."
    )
    s3_part_bytes: int = Field(16 * MiB, ge=5 * MiB, description="Multipart part size for S3 writes.")
    s3_max_concurrency: int = Field(4, ge=1, le=64, description="Parts uploaded in parallel per S3 write.")
    audit_interval_s: float = Field(
        10.0, gt=0, le=3600, description="Repeated 401s per source are written as one audit row per interval."
    )
    audit_max_sources: int = Field(
        10_000, ge=1, description="Distinct 401 sources kept per interval; more are counted under source '*'."
    )
    body_idle_timeout_s: float = Field(
        30.0, gt=0, description="A request body that sends nothing for this long is answered 408."
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time a connection has to send a request's line and headers (then 408, closed)."
    )
    max_header_bytes: int = Field(32 * 1024, ge=4096, description="Largest request line + headers (431 beyond).")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="Idle keep-alive connections are closed after this.")
    max_connections: int = Field(
        1000, ge=1, description="Concurrent connections (and requests) served; beyond, uvicorn answers 503."
    )
    workers: int = Field(
        1, ge=1, le=64, description="Server processes `cgstore serve` runs (each with its own pool and counters)."
    )
    worker_threads: int = Field(
        40, ge=1, description="Threads that run database and storage calls (anyio's default limiter)."
    )
    malloc_arenas: int = Field(
        2, ge=0, le=64,
        description="glibc malloc arenas `cgstore serve` allows (0: glibc's default of 8 per core); "
        "MALLOC_ARENA_MAX, when set, wins.",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="Bearer token `GET /metrics` requires; unset or empty, /metrics answers 404 to everyone.",
    )
    metrics_families: str = Field(
        "",
        description="Comma-separated families that get their own `family` label in the resolve metric; "
        "every other family is counted as `other`.",
    )
    log_level: str = "info"

    @cached_property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.home / 'cgstore.sqlite3').absolute()}"

    @cached_property
    def resolved_storage_url(self) -> str:
        if self.storage_url:
            return self.storage_url
        return str((self.home / "blobs").absolute())

    @cached_property
    def metrics_family_labels(self) -> frozenset[str]:
        """The allow-list of ``metrics_families``, parsed once."""
        return frozenset(name.strip() for name in self.metrics_families.split(",") if name.strip())

    @property
    def spool_dir(self) -> Path:
        """Where admission spools an archive to read it (private, under CGSTORE_HOME)."""
        return self.home / "spool"

    @cached_property
    def signing_key_path(self) -> Path:
        return self.token_signing_key or self.home / "token-signing-key.pem"

    @cached_property
    def keys_dir(self) -> Path:
        return self.token_keys_dir or self.home / "keys"

    @property
    def storage_is_s3(self) -> bool:
        return self.resolved_storage_url.startswith("s3://")


def parse_s3_url(url: str) -> tuple[str, str | None, str | None]:
    """``s3://bucket?endpoint_url=…&region=…`` → (bucket, endpoint_url, region)."""
    parsed = urlparse(url)
    query = parse_qs(parsed.query)

    def one(name: str) -> str | None:
        values = query.get(name)
        return values[0] if values else None

    if not parsed.netloc:
        raise ValueError(f"storage URL {url!r} names no bucket")
    return parsed.netloc, one("endpoint_url"), one("region")
