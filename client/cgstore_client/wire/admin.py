"""Wire types of the admin views (docs/operations.md "Admin views"): ``GET /v1/admin/stats`` and ``cgstore ls/show/stats``.

The CLI's ``--json`` lines are these same objects, so a tool reads the
endpoint and the command alike. Bounds of the lists are defined here, once.
"""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, ConfigDict, Field

from cgstore_client.wire.audit import AuditEntry

#: Publishers listed in ``top_publishers``.
STATS_TOP_PUBLISHERS = 10
#: Entries in each of ``recent_conflicts``, ``recent_denials`` and ``unhealthy``.
STATS_RECENT = 20
#: Rows ``cgstore ls`` prints unless told otherwise.
DEFAULT_LS_LIMIT = 100


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RecordCount(WireModel):
    """Live records of one (family, sm, lane)."""

    family: str
    sm: str
    lane: str
    records: int


class PublisherCount(WireModel):
    publisher: str = Field(description="The principal (token sub) that published.")
    records: int = Field(description="Its live records.")


class StorageBytes(WireModel):
    """What deduplication saves: each record's bytes counted per record, against the bytes kept once."""

    blobs: int = Field(description="Blob rows (every stored blob, referenced or not).")
    stored_bytes: int = Field(description="Sum of every stored blob's size.")
    referenced_bytes: int = Field(description="Sum of the sizes of the distinct blobs live records bind.")
    logical_bytes: int = Field(description="Sum over live records of their artifact and component sizes.")
    dedup_ratio: float | None = Field(description="logical_bytes / referenced_bytes; null with no records.")


class RecordSummary(WireModel):
    """One line of ``cgstore ls`` and of ``unhealthy``."""

    repo: str
    key: str
    family: str
    sm: str
    lane: str
    health: str
    publisher: str
    artifact_digest: str
    artifact_size: int
    created_at: dt.datetime
    #: Workers' reports that this graph is not their live model (``…/{key}:report``).
    drift_reports: int = 0
    #: Published in a private cache (a ``principal`` repo): the JSON API shows it to its publisher only.
    private: bool = False


class AdminStats(WireModel):
    """``GET /v1/admin/stats`` and ``cgstore stats --json``."""

    live_records: int
    records: list[RecordCount] = Field(description="Live records per family, sm and lane, most first.")
    storage: StorageBytes
    top_publishers: list[PublisherCount] = Field(max_length=STATS_TOP_PUBLISHERS)
    recent_conflicts: list[AuditEntry] = Field(
        description="Newest publishes refused KEY_CONFLICT.", max_length=STATS_RECENT
    )
    recent_denials: list[AuditEntry] = Field(
        description="Newest refusals (DENIED, ROOT_RESERVED, 401s...).", max_length=STATS_RECENT
    )
    unhealthy: list[RecordSummary] = Field(
        description="Newest live records the scrub took out of resolve.", max_length=STATS_RECENT
    )
    drift_reports: int = Field(0, description="Drift reports over live records.")
    drifting: list[RecordSummary] = Field(
        default_factory=list,
        max_length=STATS_RECENT,
        description="Live records with drift reports, most reported first.",
    )
