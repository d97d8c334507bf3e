"""Typed settings of the store, read from ``CGSTORE_*`` environment variables.

Each field's description is its documentation: ``docs/generate.py`` writes the
configuration table of ``docs/deploy.md`` from them (``json_schema_extra
["shown"]`` spells a default that is computed at run time). The defaults are
the embedded configuration: SQLite and a local directory under ``CGSTORE_HOME``
and an Ed25519 signing key generated there on first use, so ``cgstore serve``
needs no configuration at all.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qs, urlparse

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1 << 20
GiB = 1 << 30


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CGSTORE_", extra="ignore")

    home: Path = Field(
        Path(".cgstore"),
        description="state directory of the embedded default (SQLite file, blob directory, signing key)",
        json_schema_extra={"shown": "./.cgstore"},
    )
    host: str = Field("127.0.0.1", description="listen address of `cgstore serve`")
    port: int = Field(8080, description="listen port")
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL, e.g. `postgresql+psycopg://user:pw@host:5432/cgstore`",
        json_schema_extra={"shown": "sqlite:///$CGSTORE_HOME/cgstore.sqlite3"},
    )
    storage_url: str | None = Field(
        None,
        description="a directory (or `file://` URL), or `s3://bucket[/prefix]?endpoint_url=…&region=…`",
        json_schema_extra={"shown": "$CGSTORE_HOME/blobs"},
    )
    s3_public_endpoint_url: str | None = Field(
        None,
        description="endpoint written into presigned URLs, when clients reach S3 by another name than the store does",
    )
    token_signing_key: Path | None = Field(
        None,
        description="the bootstrap Ed25519 private key of the key ring (PEM, PKCS8); generated once (0600) if absent",
        json_schema_extra={"shown": "$CGSTORE_HOME/token-signing-key.pem"},
    )
    token_keys_dir: Path | None = Field(
        None,
        description="where `cgstore keys rotate` writes new private keys (`<kid>.pem`, 0600, directory 0700)",
        json_schema_extra={"shown": "$CGSTORE_HOME/keys"},
    )
    token_issuer: str = Field("cgstore", description="`iss` of minted tokens, required on verified ones")
    public_url: str | None = Field(
        None,
        description="the store's URL as clients reach it (`https://store.example[/prefix]`): redirects and the "
        "blob URLs of resolve and discover answers are built from it; unset, they are relative paths (never built "
        "from the request's `Host` header)",
    )
    redirect_downloads: bool = Field(True, description="on S3, answer blob GETs with 307 to a presigned URL")
    presign_ttl_s: int = Field(300, ge=10, le=7 * 24 * 3600, description="lifetime of presigned download URLs")
    max_blob_bytes: int = Field(64 * GiB, ge=1, description="largest blob accepted (413 `TOO_LARGE` beyond)")
    max_json_bytes: int = Field(1 * MiB, ge=1024, description="largest JSON request body accepted")
    upload_session_ttl_s: int = Field(
        24 * 3600,
        ge=1,
        description="idle time after which a resumable upload session expires and its bytes are reclaimed",
    )
    reaper_interval_s: float = Field(60.0, gt=0, description="how often the server reclaims expired upload sessions")
    gc_interval_s: float = Field(
        3600.0, gt=0, description="how often the server collects garbage (one replica at a time)"
    )
    gc_grace_s: int = Field(
        24 * 3600,
        ge=0,
        description="blobs linked (or yanked records changed) more recently than this are kept; "
        "orphaned multipart writes older than this are aborted",
    )
    gc_batch_size: int = Field(500, ge=1, le=10_000, description="blobs condemned and deleted per GC batch (1–10000)")
    scrub_interval_s: float = Field(
        0.0,
        ge=0,
        description="how often the server scrubs the next 100 blobs (under the `scrub` lease, one replica at a "
        "time); `0`: never, only `cgstore scrub`",
    )
    lease_ttl_s: float = Field(
        120.0,
        gt=0,
        description="lifetime of a background task's lease (reaper, GC, scrub); a crashed holder's lapses after this",
    )
    claim_ttl_s: float = Field(
        90.0,
        gt=0,
        le=3600,
        description="lifetime of a mint claim (`…/compiled-graphs:claim`) unless its holder beats it (every third "
        "of this); a claim not beaten in time expires and the next claimer takes the mint over",
    )
    claim_backoff_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="after a mint released `failed`, the next grant of the declaration waits this × 2^(failures−1) "
        "seconds (at most an hour); 5 failures or expiries in a row make it `failing` until cleared",
    )
    s3_part_bytes: int = Field(16 * MiB, ge=5 * MiB, description="multipart part size for S3 writes (≥ 5 MiB)")
    s3_payload_signing: Literal["auto", "always", "never"] = Field(
        "auto",
        description="whether the store SHA-256-signs the bytes of each S3 write (SigV4 payload signing: about 1 ms "
        "of the store's CPU per MiB, and as much again in the S3 server checking it). `auto`: only over plain "
        "HTTP to another host, where nothing else would catch bytes changed on the way; not over HTTPS (TLS "
        "authenticates every byte) nor to a loopback endpoint (no wire). `always` / `never`: as said. Every "
        "blob's bytes are verified by blake3 as they reach the store, by every client that downloads them and by "
        "`cgstore scrub`, whatever this says (see docs/deploy.md)",
    )
    s3_max_concurrency: int = Field(
        4,
        ge=1,
        le=64,
        description="parts uploaded in parallel per S3 write (memory ≈ (this + 1) × part size per upload)",
    )
    body_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a request body that sends nothing for this long is answered 408 `REQUEST_TIMEOUT` "
        "(and leaves nothing behind)",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="time a connection has to send a request line and headers; then 408 and closed"
    )
    max_header_bytes: int = Field(
        32 * 1024, ge=4096, description="largest request line + headers; beyond, 431 `TOO_LARGE` and closed"
    )
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="idle keep-alive connections are closed after this")
    max_connections: int = Field(
        1000,
        ge=1,
        description="connections (and requests) served at once; beyond, 503 `UNAVAILABLE` and closed",
    )
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="server processes `cgstore serve` runs on one port (uvicorn workers); each has its own "
        "database pool, reaper, GC loop (lease-guarded, so still one at a time), denial log and `/metrics` "
        "counters, and `CGSTORE_MAX_CONNECTIONS` applies per process",
    )
    worker_threads: int = Field(
        40, ge=1, description="threads that run database and storage calls; request bodies never hold one"
    )
    malloc_arenas: int = Field(
        2,
        ge=0,
        le=64,
        description="glibc malloc arenas `cgstore serve` allows (`0`: glibc's 8 per core; `MALLOC_ARENA_MAX`, "
        "when set, wins): bounds the RSS that 40 request threads keep (`bench/load.py`)",
    )
    audit_interval_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="repeated 401s are written as one audit row per (source address, code) per interval, with a count",
    )
    audit_checkpoint_interval_s: float = Field(
        300.0,
        gt=0,
        description="how often the audit chain's head is signed into `audit_checkpoints` (if it moved), "
        "under the `audit-checkpoint` lease; `cgstore audit verify` checks them",
    )
    audit_max_sources: int = Field(
        10_000,
        ge=1,
        description="distinct 401 sources kept in memory per interval; further ones are counted under source `*`",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="bearer token `GET /metrics` requires (compared in constant time); unset or empty, "
        "`/metrics` answers 404 to everyone",
    )
    metrics_families: str = Field(
        "",
        description="comma-separated families that get their own `family` label in "
        "`cgstore_resolve_answers_total`; every other family is counted as `other`",
    )
    console_aggregates_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="the admin console's overview and storage figures (whole-registry counts and sums) are "
        "computed at most once per this many seconds per process and shown with their time (older figures are "
        "shown while the next are computed in the background); 0: on every view",
    )
    events_max_waiters: int = Field(
        800,
        ge=1,
        description="long-polls of `GET /v1/compiled-graphs:events` waiting at once per process (they hold no "
        "thread and no database connection while waiting, but each holds one of `CGSTORE_MAX_CONNECTIONS`: keep "
        "this below it, so that other requests are still served); beyond, 503 `UNAVAILABLE` with `Retry-After`",
    )
    events_max_wait_s: int = Field(
        30,
        ge=0,
        le=30,
        description="the longest one long-poll of the events feed waits, whatever its `wait` asks (≤ 30, the "
        "protocol's bound)",
    )
    events_poll_s: float = Field(
        0.25,
        gt=0,
        le=1.0,
        description="while a long-poll waits, how often each process reads the feed's head to notice other "
        "replicas' publishes and yanks (one indexed read per process, however many wait); its own are noticed "
        "at once",
    )
    events_retention_s: int = Field(
        7 * 24 * 3600,
        ge=3600,
        description="events older than this are trimmed by the GC task (the newest is always kept); a cursor "
        "older than what is kept is answered 400 `BAD_REQUEST` (`detail.expired`): start again at `since=now`",
    )
    upstream_url: str | None = Field(
        None,
        description="the upstream store's URL (`https://store.example[/prefix]`): set, this store is a read-only "
        'regional mirror of it (docs/deploy.md "Regional mirrors"); it answers from its own rows first and pulls '
        "what it lacks from the upstream once, verified against the upstream's trusted keys (`cgstore mirror trust`)",
    )
    upstream_token_file: Path | None = Field(
        None,
        description="file holding the token the mirror reads the upstream with (read once at start; the token "
        "appears in no answer, log, metric, audit entry or console page): the mirror reads only what it grants",
    )
    upstream_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="bound of each upstream call's connect and of each wait for its next bytes; past it the "
        'upstream counts as unavailable (misses answered with `detail.upstream = "unavailable"`, never a hang)',
    )
    mirror_families: str = Field(
        "",
        description="comma-separated globs (`flux-*,sdxl`) of the families a mirror pulls; empty: every family",
    )
    mirror_sm: str = Field(
        "",
        description="comma-separated globs (`sm_90*`) of the GPU architectures a mirror pulls; empty: every one",
    )
    mirror_negative_ttl_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="how long a mirror remembers that the upstream has no record of a key or declaration "
        "(asked again after this); 0: never remembered",
    )
    mirror_preheat: bool = Field(
        False,
        description="on a mirror (`CGSTORE_UPSTREAM_URL` set): pull each record the upstream's events feed announces "
        "as published, when it matches `CGSTORE_MIRROR_FAMILIES` / `CGSTORE_MIRROR_SM`, before any worker asks",
    )
    mirror_evict_after: int = Field(
        0,
        ge=0,
        description="on a mirror: the GC task evicts mirrored records whose blobs no download served for this many seconds "
        "(pulled again from the upstream on demand); 0: never evict",
        json_schema_extra={"shown": "0 (never)"},
    )
    mirror_follow_wait_s: int = Field(
        20,
        ge=1,
        le=30,
        description="on a mirror: how long each long-poll of the upstream's events feed waits; upstream yanks are "
        "applied within this + 1 s",
    )
    log_level: str = Field("info", description="log level")

    @field_validator("public_url", "upstream_url")
    @classmethod
    def _absolute_http_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        """An http(s) origin and optional path prefix, kept without its trailing slash; empty is unset."""
        if not value:
            return None
        parsed = urlparse(value)
        if (
            parsed.scheme not in ("http", "https")
            or not parsed.netloc
            or parsed.query
            or parsed.fragment
            or parsed.params
            or "@" in parsed.netloc
        ):
            variable = f"CGSTORE_{info.field_name.upper()}"
            raise ValueError(f"{variable} is an http(s) URL without credentials, query or fragment")
        return value.rstrip("/")

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

    @cached_property
    def mirror_family_globs(self) -> tuple[str, ...]:
        """``mirror_families`` parsed once (empty: every family)."""
        return tuple(glob.strip() for glob in self.mirror_families.split(",") if glob.strip())

    @cached_property
    def mirror_sm_globs(self) -> tuple[str, ...]:
        """``mirror_sm`` parsed once (empty: every architecture)."""
        return tuple(glob.strip() for glob in self.mirror_sm.split(",") if glob.strip())

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
