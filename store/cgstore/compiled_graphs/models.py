"""Tables of the compiled-graphs feature: records and the named components they bind.

One *live* record per (repo, key, scope): a partial unique index over the
rows whose ``yanked_at`` is NULL. The scope is empty, except in a private
cache (visibility ``principal``), where it is the publisher: each tenant's
cache holds its own record of a key, and one tenant's publish tells nothing
of another's. A yanked record stays for audit, and the key can be
published again. Resolve, discover and listing read only live rows, through
partial indexes, so their cost follows the number of keys asked or rows listed,
not the size of the table; resolve's and discover's lead with what they match
on, then ``(repo_id, publisher)``, so they touch only the rows the caller may
read (``access`` "Resolving").
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, BigInteger, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime, utcnow

HEALTH_OK = "ok"
HEALTH_STATES = (HEALTH_OK, "blob_missing", "blob_corrupt")

_LIVE = text("yanked_at IS NULL")
_UNHEALTHY = text("yanked_at IS NULL AND health <> 'ok'")
_RECORD_ID = BigInteger().with_variant(Integer(), "sqlite")


class CompiledGraph(Base):
    """A published compiled graph: the manifest, what admission derived from the archive, who published it.

    Columns:
      id                    surrogate key; the listing cursor.
      repo_id               the repo the record is published in.
      key                   the ck1 key.
      kind                  artifact kind (aot-inductor).
      format                artifact format (pt2).
      family                model family: discovery scope.
      lane                  kernel lane <linear>+<modulation>.
      sm                    GPU architecture or CPU ISA (key axis).
      graph_digest          graph digest, measured from the archive (key axis).
      envelope              canonical envelope document.
      envelope_digest       digest of the envelope.
      toolchain             canonical toolchain document.
      toolchain_digest      digest of the toolchain.
      recorded_versions     recorded-only versions (diffusers...), never hashed.
      artifact_digest       the .pt2 blob.
      artifact_size         its size in bytes.
      component_set         digest of the sorted (name, digest, size) component list.
      layout_display        layout stamp as displayed; never parsed.
      layout_topology       layout topology digest.
      layout_quant          layout quant digest.
      input_contract        input contract derived from the archive.
      binding_table         every constant and its source: checkpoint or component:<name>.
      kernel_lane           kernel-lane verdict from the archive's metadata.
      kernel_lane_evidence  lane timings measured at mint.
      mint_phases           mint phase timings.
      publisher             principal (token sub) that published.
      publisher_jti         jti of the publishing token.
      created_at            publish time.
      yanked_at             when an admin yanked it (NULL: live).
      yanked_by             who yanked it.
      yank_reason           why.
      health                ok | blob_missing | blob_corrupt (set by the scrub).
      receipt               the signed publish receipt (compiled_graphs/receipts.py), answered with the record.
      receipt_kid           the key that signed the receipt (re-signed when that key retires).
      scope                 write-once scope: '' (the repo), or the publisher in a private cache.
      discovery_digest      what discover matches a declaration on (cgstore_client.binding.discovery_digest):
                            family, envelope, sm, keyed toolchain and the model libraries' versions.
      binding_signature     bs1: the tensors bound from the checkpoint (NULL: published before 0012).
      release               the publisher's release label (endpoint release, image), or NULL.
      code_fingerprint      cf1: the model's source files, as the publisher declared it, or NULL.
      drift_reports         how many times a worker reported serving this graph drifted from its live model.
      origin                which store admitted the record: NULL, this one; on a regional mirror, the upstream's
                            URL (the row and its receipt were pulled from there, unchanged).
    """

    __tablename__ = "compiled_graphs"
    __table_args__ = (
        # Write-once: at most one live record per key in a repo (per publisher in a private cache).
        Index(
            "uq_compiled_graphs_live_key",
            "repo_id",
            "key",
            "scope",
            unique=True,
            sqlite_where=_LIVE,
            postgresql_where=_LIVE,
        ),
        # Resolve: key first (the worker asks by key), then family; then the searched repo and, in a
        # private cache, the reader as publisher: only rows the caller may read are ever touched.
        Index(
            "ix_compiled_graphs_resolve",
            "key",
            "family",
            "repo_id",
            "publisher",
            sqlite_where=_LIVE,
            postgresql_where=_LIVE,
        ),
        # Listing: keyset pagination by id within a repo (optionally one family).
        Index("ix_compiled_graphs_list", "repo_id", "id", sqlite_where=_LIVE, postgresql_where=_LIVE),
        Index("ix_compiled_graphs_list_family", "repo_id", "family", "id", sqlite_where=_LIVE, postgresql_where=_LIVE),
        # Discover: every match shares the digest; then, as for resolve, the searched repo and the
        # reader (the optional filters narrow only the rows the caller may read).
        Index(
            "ix_compiled_graphs_discover",
            "discovery_digest",
            "repo_id",
            "publisher",
            sqlite_where=_LIVE,
            postgresql_where=_LIVE,
        ),
        # The admin views' unhealthy records: few rows, found without a scan.
        Index("ix_compiled_graphs_unhealthy", "id", sqlite_where=_UNHEALTHY, postgresql_where=_UNHEALTHY),
    )

    id: Mapped[int] = mapped_column(_RECORD_ID, primary_key=True, autoincrement=True)
    repo_id: Mapped[int] = mapped_column(Integer, ForeignKey("repos.id", ondelete="CASCADE"), nullable=False)
    key: Mapped[str] = mapped_column(String(96), nullable=False)
    kind: Mapped[str] = mapped_column(String(32), nullable=False)
    format: Mapped[str] = mapped_column(String(16), nullable=False)
    family: Mapped[str] = mapped_column(String(100), nullable=False)
    lane: Mapped[str] = mapped_column(String(64), nullable=False)
    sm: Mapped[str] = mapped_column(String(128), nullable=False)
    graph_digest: Mapped[str] = mapped_column(String(71), nullable=False)
    envelope: Mapped[dict] = mapped_column(JSON, nullable=False)
    envelope_digest: Mapped[str] = mapped_column(String(71), nullable=False)
    toolchain: Mapped[dict] = mapped_column(JSON, nullable=False)
    toolchain_digest: Mapped[str] = mapped_column(String(71), nullable=False)
    recorded_versions: Mapped[dict] = mapped_column(JSON, nullable=False)
    # Indexed for garbage collection, which asks per blob whether any record names it.
    artifact_digest: Mapped[str] = mapped_column(String(71), ForeignKey("blobs.digest"), nullable=False, index=True)
    artifact_size: Mapped[int] = mapped_column(BigInteger, nullable=False)
    component_set: Mapped[str] = mapped_column(String(71), nullable=False)
    layout_display: Mapped[str | None] = mapped_column(String(200), nullable=True)
    layout_topology: Mapped[str | None] = mapped_column(String(71), nullable=True)
    layout_quant: Mapped[str | None] = mapped_column(String(71), nullable=True)
    input_contract: Mapped[dict] = mapped_column(JSON, nullable=False)
    binding_table: Mapped[list] = mapped_column(JSON, nullable=False)
    kernel_lane: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    kernel_lane_evidence: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    mint_phases: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    publisher: Mapped[str] = mapped_column(String(200), nullable=False)
    publisher_jti: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    yanked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    yanked_by: Mapped[str | None] = mapped_column(String(200), nullable=True)
    yank_reason: Mapped[str | None] = mapped_column(String(1000), nullable=True)
    health: Mapped[str] = mapped_column(String(16), nullable=False, default=HEALTH_OK)
    receipt: Mapped[str | None] = mapped_column(Text, nullable=True)
    receipt_kid: Mapped[str | None] = mapped_column(String(16), nullable=True, index=True)
    scope: Mapped[str] = mapped_column(String(200), nullable=False, default="")
    discovery_digest: Mapped[str | None] = mapped_column(String(71), nullable=True)
    binding_signature: Mapped[str | None] = mapped_column(String(71), nullable=True)
    release: Mapped[str | None] = mapped_column(String(128), nullable=True)
    code_fingerprint: Mapped[str | None] = mapped_column(String(71), nullable=True)
    drift_reports: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default=text("0"))
    origin: Mapped[str | None] = mapped_column(String(300), nullable=True)


class CompiledGraphComponent(Base):
    """A named CAS component a record binds (the blob is stored once, however many records share it).

    Columns:
      record_id  the record.
      name       component name, unique per record.
      digest     the safetensors blob.
      size       its size in bytes.
    """

    __tablename__ = "compiled_graph_components"

    record_id: Mapped[int] = mapped_column(
        _RECORD_ID, ForeignKey("compiled_graphs.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest: Mapped[str] = mapped_column(String(71), ForeignKey("blobs.digest"), nullable=False, index=True)
    size: Mapped[int] = mapped_column(BigInteger, nullable=False)


class CompiledGraphEvent(Base):
    """One entry of the record events feed (``compiled_graphs/events.py``): a record published or yanked.

    Append-only, written in the transaction of the publish or the yank it tells
    of, so a committed record and its event are one fact. Ids are gapless and
    in commit order (each is the previous head plus one, taken under a lock held
    until commit), so a reader's position is a plain id and a position below
    the oldest kept entry means entries were trimmed past it. No foreign key to
    the record: GC may forget a long-yanked record while its events are kept.

    Columns:
      id                 the position in the feed: gapless, commit order.
      at                 when the publish or yank wrote it, just before its commit (the store's clock).
      kind               ``published`` or ``yanked``.
      repo_id            the record's repo (events go with a deleted repo).
      publisher          the record's publisher: in a private cache only it reads the event.
      family             the record's family (the feed's filter).
      key                the record's ck1 key.
      discovery_digest   a publish's discovery digest (NULL on a yank).
      binding_signature  a publish's binding signature (NULL on a yank).
      release            a publish's release label (NULL on a yank).
      reason             a yank's reason (NULL on a publish).
    """

    __tablename__ = "record_events"
    __table_args__ = (
        # A reader's events: the searched repos' (and, in a private cache, the reader's own) after its position.
        Index("ix_record_events_repo", "repo_id", "id"),
        Index("ix_record_events_reader", "repo_id", "publisher", "id"),
        # Trimming by age.
        Index("ix_record_events_at", "at"),
    )

    id: Mapped[int] = mapped_column(_RECORD_ID, primary_key=True, autoincrement=False)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    kind: Mapped[str] = mapped_column(String(16), nullable=False)
    repo_id: Mapped[int] = mapped_column(Integer, ForeignKey("repos.id", ondelete="CASCADE"), nullable=False)
    publisher: Mapped[str] = mapped_column(String(200), nullable=False)
    family: Mapped[str] = mapped_column(String(100), nullable=False)
    key: Mapped[str] = mapped_column(String(96), nullable=False)
    discovery_digest: Mapped[str | None] = mapped_column(String(71), nullable=True)
    binding_signature: Mapped[str | None] = mapped_column(String(71), nullable=True)
    release: Mapped[str | None] = mapped_column(String(128), nullable=True)
    reason: Mapped[str | None] = mapped_column(String(1000), nullable=True)
