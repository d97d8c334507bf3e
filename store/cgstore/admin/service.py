"""The facts behind ``cgstore ls/show/stats``, ``GET /v1/admin/stats`` and the console, read in one session each.

Counts are aggregates the database computes (GROUP BY, SUM), so the answer's
size follows the number of (family, sm, lane) combinations and the list
bounds in ``cgstore_client.wire.admin``, never the number of records. Every
view reads live records only (yanked ones are history, in the audit log).

These are the host's views: they include private caches' records (the JSON
API shows those to their publisher only), each marked ``private``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select, union
from sqlalchemy.orm import Session

from cgstore.access import is_admin
from cgstore.audit.models import AuditEvent
from cgstore.audit.service import to_entry
from cgstore.blobs.models import Blob
from cgstore.compiled_graphs.models import HEALTH_OK, HEALTH_STATES, CompiledGraph, CompiledGraphComponent
from cgstore.compiled_graphs.records import to_record
from cgstore.context import StoreContext
from cgstore.core.errors import BadRequest, KeyConflict
from cgstore.repos.models import Repo
from cgstore.tokens.claims import Claims
from cgstore_client.wire.admin import (
    DEFAULT_LS_LIMIT,
    STATS_RECENT,
    STATS_TOP_PUBLISHERS,
    AdminStats,
    PublisherCount,
    RecordCount,
    RecordSummary,
    StorageBytes,
)
from cgstore_client.wire.records import Record

_LIVE = CompiledGraph.yanked_at.is_(None)


def read_stats(ctx: StoreContext, claims: Claims) -> AdminStats:
    """``GET /v1/admin/stats``: for an admin token only."""
    is_admin(claims).enforce()
    with ctx.db.session() as session:
        return stats(session)


def stats(session: Session) -> AdminStats:
    counts = [
        RecordCount(family=family, sm=sm, lane=lane, records=n)
        for family, sm, lane, n in session.execute(
            select(CompiledGraph.family, CompiledGraph.sm, CompiledGraph.lane, func.count())
            .where(_LIVE)
            .group_by(CompiledGraph.family, CompiledGraph.sm, CompiledGraph.lane)
            .order_by(func.count().desc(), CompiledGraph.family, CompiledGraph.sm, CompiledGraph.lane)
        )
    ]
    publishers = [
        PublisherCount(publisher=publisher, records=n)
        for publisher, n in session.execute(
            select(CompiledGraph.publisher, func.count())
            .where(_LIVE)
            .group_by(CompiledGraph.publisher)
            .order_by(func.count().desc(), CompiledGraph.publisher)
            .limit(STATS_TOP_PUBLISHERS)
        )
    ]
    return AdminStats(
        live_records=sum(c.records for c in counts),
        records=counts,
        storage=storage_bytes(session),
        top_publishers=publishers,
        recent_conflicts=_recent(session, AuditEvent.outcome == KeyConflict.code),
        recent_denials=_recent(session, AuditEvent.outcome.not_in(["ok", KeyConflict.code])),
        unhealthy=_summaries(
            session, select(CompiledGraph, Repo).where(CompiledGraph.health != HEALTH_OK), STATS_RECENT
        ),
        drift_reports=session.scalar(select(func.coalesce(func.sum(CompiledGraph.drift_reports), 0)).where(_LIVE)),
        drifting=_summaries(
            session,
            select(CompiledGraph, Repo).where(CompiledGraph.drift_reports > 0),
            STATS_RECENT,
            most=CompiledGraph.drift_reports.desc(),
        ),
    )


def storage_bytes(session: Session) -> StorageBytes:
    blobs, stored = session.execute(select(func.count(), func.coalesce(func.sum(Blob.size), 0))).one()
    live_ids = select(CompiledGraph.id).where(_LIVE)
    artifacts = session.scalar(select(func.coalesce(func.sum(CompiledGraph.artifact_size), 0)).where(_LIVE))
    components = session.scalar(
        select(func.coalesce(func.sum(CompiledGraphComponent.size), 0)).where(
            CompiledGraphComponent.record_id.in_(live_ids)
        )
    )
    referenced_digests = union(
        select(CompiledGraph.artifact_digest).where(_LIVE),
        select(CompiledGraphComponent.digest).where(CompiledGraphComponent.record_id.in_(live_ids)),
    ).subquery()
    referenced = session.scalar(
        select(func.coalesce(func.sum(Blob.size), 0)).where(Blob.digest.in_(select(referenced_digests.c[0])))
    )
    logical = int(artifacts) + int(components)
    return StorageBytes(
        blobs=blobs,
        stored_bytes=int(stored),
        referenced_bytes=int(referenced),
        logical_bytes=logical,
        dedup_ratio=round(logical / referenced, 3) if referenced else None,
    )


def health_counts(session: Session) -> dict[str, int]:
    """Live records per unhealthy state (few rows: the unhealthy records' partial index finds them)."""
    rows = session.execute(
        select(CompiledGraph.health, func.count())
        .where(_LIVE, CompiledGraph.health != HEALTH_OK)
        .group_by(CompiledGraph.health)
    )
    return {health: n for health, n in rows}


def _recent(session: Session, condition) -> list:
    events = session.scalars(select(AuditEvent).where(condition).order_by(AuditEvent.id.desc()).limit(STATS_RECENT))
    return [to_entry(event) for event in events]


def _summaries(session: Session, query, limit: int, most=None) -> list[RecordSummary]:
    """Live records of ``query``, newest first (after ``most``, an ordering, when given)."""
    order = [CompiledGraph.id.desc()] if most is None else [most, CompiledGraph.id.desc()]
    rows = session.execute(
        query.join(Repo, Repo.id == CompiledGraph.repo_id).where(_LIVE).order_by(*order).limit(limit)
    )
    return [_summary(row, repo) for row, repo in rows]


def _summary(row: CompiledGraph, repo: Repo) -> RecordSummary:
    return RecordSummary(
        repo=f"{repo.owner}/{repo.name}",
        key=row.key,
        family=row.family,
        sm=row.sm,
        lane=row.lane,
        health=row.health,
        publisher=row.publisher,
        artifact_digest=row.artifact_digest,
        artifact_size=row.artifact_size,
        created_at=row.created_at,
        drift_reports=row.drift_reports,
        private=row.scope != "",
    )


@dataclass(frozen=True)
class RecordFilter:
    """What ``cgstore ls`` and the console's records page select; ``None`` means "any". Exact matches."""

    family: str | None = None
    sm: str | None = None
    lane: str | None = None
    #: ``owner/name``.
    repo: str | None = None
    publisher: str | None = None
    #: One of ``HEALTH_STATES``.
    health: str | None = None


def records_page(
    session: Session, where: RecordFilter, *, before: int | None = None, limit: int = DEFAULT_LS_LIMIT
) -> tuple[list[RecordSummary], int | None]:
    """Live records in every repo matching ``where``, newest first, keyset-paged by id below ``before``.

    Returns the page and the id the next page starts below (None on the last page).
    """
    query = select(CompiledGraph, Repo).join(Repo, Repo.id == CompiledGraph.repo_id).where(_LIVE)
    for column, value in (
        (CompiledGraph.family, where.family),
        (CompiledGraph.sm, where.sm),
        (CompiledGraph.lane, where.lane),
        (CompiledGraph.publisher, where.publisher),
    ):
        if value is not None:
            query = query.where(column == value)
    if where.repo is not None:
        # The repo's id first, then its records by it: the planner walks the repo's
        # (repo_id, id) index instead of every record joined to repos.
        owner, _, name = where.repo.partition("/")
        repo_id = session.scalar(select(Repo.id).where(Repo.owner == owner, Repo.name == name))
        if repo_id is None:
            return [], None
        query = query.where(CompiledGraph.repo_id == repo_id)
    if where.health is not None:
        if where.health not in HEALTH_STATES:
            raise BadRequest(f"health must be one of {', '.join(HEALTH_STATES)}", health=where.health[:32])
        query = query.where(CompiledGraph.health == where.health)
        if where.health != HEALTH_OK:  # lets the planner use the unhealthy records' partial index
            query = query.where(CompiledGraph.health != HEALTH_OK)
    if before is not None:
        query = query.where(CompiledGraph.id < before)
    # limit + 1: the extra row only tells whether a next page exists.
    rows = session.execute(query.order_by(CompiledGraph.id.desc()).limit(max(1, limit) + 1)).all()
    page = rows[:limit]
    return [_summary(row, repo) for row, repo in page], (page[-1][0].id if len(rows) > limit else None)


def list_records(
    session: Session, *, family: str | None = None, sm: str | None = None, limit: int = DEFAULT_LS_LIMIT
) -> list[RecordSummary]:
    """``cgstore ls``: the newest live records in every repo, optionally of one family and sm."""
    return records_page(session, RecordFilter(family=family, sm=sm), limit=limit)[0]


def show(session: Session, key: str) -> list[Record]:
    """``cgstore show KEY``: the live record of ``key`` in every repo holding one."""
    return [record for record, _ in shown(session, key)]


def shown(session: Session, key: str, repo: str | None = None) -> list[tuple[Record, bool]]:
    """The live records of ``key`` (in every repo, or only ``owner/name``), each with whether it is private.

    Several in one repo only in a private cache (one per publisher).
    """
    query = (
        select(CompiledGraph, Repo).join(Repo, Repo.id == CompiledGraph.repo_id).where(CompiledGraph.key == key, _LIVE)
    )
    if repo is not None:
        owner, _, name = repo.partition("/")
        query = query.where(Repo.owner == owner, Repo.name == name)
    found = session.execute(query.order_by(Repo.owner, Repo.name, CompiledGraph.id)).all()
    components: dict[int, list[CompiledGraphComponent]] = {}
    for component in session.scalars(
        select(CompiledGraphComponent)
        .where(CompiledGraphComponent.record_id.in_([row.id for row, _ in found]))
        .order_by(CompiledGraphComponent.name)
    ):
        components.setdefault(component.record_id, []).append(component)
    return [(to_record(repo, row, components.get(row.id, [])), row.scope != "") for row, repo in found]
