"""Read, list and yank records: one record of a repo, a repo's live records paged, an admin's yank.

A record the caller may not read answers exactly like an absent one; a private
cache's reader sees only its own records.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Iterator

from pydantic_core import to_json
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from cgstore import access
from cgstore.audit.service import record as audit
from cgstore.compiled_graphs import events
from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphComponent
from cgstore.compiled_graphs.publishing import live_query
from cgstore.context import StoreContext
from cgstore.core.cursors import CURSOR_LEN
from cgstore.core.db import utcnow
from cgstore.core.errors import (
    Conflict,
    NameUnknown,
    StoreError,
    maybe_hidden_miss,
)
from cgstore.core.names import validate_owner, validate_repo
from cgstore.repos.models import Repo
from cgstore.repos.service import find_repo, readable_repo, yank_decision
from cgstore.tokens.claims import Claims
from cgstore_client.keys import is_key
from cgstore_client.wire.records import (
    MAX_LIST_LIMIT,
    MAX_PAGE_BYTES,
    Artifact,
    Axes,
    Binding,
    ComponentRef,
    Evidence,
    LayoutStamp,
    Manifest,
    Publisher,
    Record,
    RecordPage,
    ToolchainAxis,
    Yank,
)


def _readable(session: Session, ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str | None) -> Repo:
    return readable_repo(
        session, claims, owner, repo, NameUnknown, "no such compiled graph", **({"key": key[:120]} if key else {})
    )


def _visible(query, claims: Claims, target: Repo):
    """The private-cache rule (``access.private_reader``): only the reader's own records, when it applies."""
    reader = access.private_reader(claims, target.visibility)
    return query if reader is None else query.where(CompiledGraph.publisher == reader)


def get_record(ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str) -> Record:
    with ctx.db.session() as session:
        target, live = readable_record(session, ctx, claims, owner, repo, key)
        components = components_of(session, [live.id])
    return to_record(target, live, components.get(live.id, []))


def readable_record(
    session: Session, ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str
) -> tuple[Repo, CompiledGraph]:
    """The live record of ``key`` the caller may read; else the one 404 an absent key gets."""
    target = _readable(session, ctx, claims, owner, repo, key)
    live = session.scalar(_visible(live_query(target.id, key), claims, target).limit(1)) if is_key(key) else None
    if live is None:
        raise _record_miss(claims, target, key)
    return target, live


def _record_miss(claims: Claims, target: Repo, key: str) -> StoreError:
    """The miss of ``key`` in ``target``; in a private cache, audited as a denial if another principal's
    record is live there (asked by the audit's flush: asking here made that miss measurably slower)."""
    reader = access.private_reader(claims, target.visibility)
    if reader is None or not is_key(key):
        return NameUnknown("no such compiled graph", key=key[:120])

    repo_id = target.id  # read now: the probe runs after this session has closed

    def published_by_another(session: Session, at: dt.datetime) -> bool:
        live_then = select(CompiledGraph.id).where(
            CompiledGraph.repo_id == repo_id,
            CompiledGraph.key == key,
            CompiledGraph.publisher != reader,
            CompiledGraph.created_at <= at,
            or_(CompiledGraph.yanked_at.is_(None), CompiledGraph.yanked_at > at),
        )
        return session.scalar(live_then.limit(1)) is not None

    return maybe_hidden_miss(NameUnknown, "no such compiled graph", published_by_another, key=key[:120])


def list_records(
    ctx: StoreContext,
    claims: Claims,
    owner: str,
    repo: str,
    *,
    family: str | None,
    sm: str | None,
    lane: str | None,
    cursor: str | None,
    limit: int,
    release: str | None = None,
) -> RecordPage:
    """Live records of a repo, oldest first, keyset-paginated by id; ``cursor`` is opaque (``core.cursors``).

    A page ends at ``limit`` records or before its JSON would pass
    ``MAX_PAGE_BYTES``, whichever comes first. Rows are read ``_LIST_BATCH`` at a
    time, so a large ``limit`` over large records never holds more than the page
    and one batch.
    """
    limit = min(limit, MAX_LIST_LIMIT)
    with ctx.db.session() as session:
        target = _readable(session, ctx, claims, owner, repo, None)
        scope = cursor_scope(target)
        after = ctx.cursors.open(scope, cursor) if cursor else 0
        query = select(CompiledGraph).where(
            CompiledGraph.repo_id == target.id, CompiledGraph.yanked_at.is_(None), CompiledGraph.id > after
        )
        filters = (
            (CompiledGraph.family, family),
            (CompiledGraph.sm, sm),
            (CompiledGraph.lane, lane),
            (CompiledGraph.release, release),
        )
        for column, value in filters:
            if value is not None:
                query = query.where(column == value)
        # limit + 1: the extra row only tells whether a next page exists.
        query = _visible(query, claims, target).order_by(CompiledGraph.id).limit(limit + 1)
        batches = session.scalars(query, execution_options={"yield_per": _LIST_BATCH}).partitions()
        return _fill_page(session, target, batches, limit, lambda last: ctx.cursors.seal(scope, last))


#: Rows read per round trip while a listing page fills.
_LIST_BATCH = 32


#: The JSON of a page around its records, with a cursor (all have one length): a page's size is this
#: plus each record and a comma.
_PAGE_FRAME_BYTES = len(RecordPage(records=[], next_cursor="c" * CURSOR_LEN).model_dump_json())


def _fill_page(
    session: Session, target: Repo, batches: Iterable[list[CompiledGraph]], limit: int, seal: Callable[[int], str]
) -> RecordPage:
    """The first records that fit ``limit`` and ``MAX_PAGE_BYTES`` (at least one); the cursor past them."""
    records: list[Record] = []
    size, last_id = _PAGE_FRAME_BYTES, 0
    for row_id, record in _records_of(session, target, batches):
        size += len(to_json(record)) + 1
        if len(records) == limit or (records and size > MAX_PAGE_BYTES):
            return RecordPage(records=records, next_cursor=seal(last_id))
        records.append(record)
        last_id = row_id
    return RecordPage(records=records, next_cursor=None)


def _records_of(session: Session, target: Repo, batches: Iterable[list[CompiledGraph]]) -> Iterator[tuple[int, Record]]:
    """Each row's id and record, built one batch at a time (its components in one query) as the page asks."""
    for batch in batches:
        components = components_of(session, [row.id for row in batch])
        for row in batch:
            yield row.id, to_record(target, row, components.get(row.id, []))


def cursor_scope(target: Repo) -> str:
    """What a listing cursor is sealed to: this repo's records (a repo made again has a new id)."""
    return f"compiled-graphs:{target.id}"


def components_of(session: Session, record_ids: list[int]) -> dict[int, list[CompiledGraphComponent]]:
    by_record: dict[int, list[CompiledGraphComponent]] = {}
    if not record_ids:
        return by_record
    rows = session.scalars(
        select(CompiledGraphComponent)
        .where(CompiledGraphComponent.record_id.in_(record_ids))
        .order_by(CompiledGraphComponent.record_id, CompiledGraphComponent.name)
    )
    for row in rows:
        by_record.setdefault(row.record_id, []).append(row)
    return by_record


def to_record(target: Repo, row: CompiledGraph, components: list[CompiledGraphComponent]) -> Record:
    layout = (
        LayoutStamp(display=row.layout_display, topology=row.layout_topology, quant=row.layout_quant)
        if row.layout_display is not None
        else None
    )
    manifest = Manifest(
        kind=row.kind,
        format=row.format,
        family=row.family,
        lane=row.lane,
        axes=Axes(
            graph=row.graph_digest,
            envelope=row.envelope,
            sm=row.sm,
            toolchain=ToolchainAxis(components=row.toolchain["components"], recorded=row.recorded_versions),
        ),
        artifact=Artifact(digest=row.artifact_digest, size=row.artifact_size),
        components=[ComponentRef(name=c.name, digest=c.digest, size=c.size) for c in components],
        layout=layout,
        evidence=Evidence(kernel_lane_evidence=row.kernel_lane_evidence, mint_phases=row.mint_phases),
        release=row.release,
        code=row.code_fingerprint,
    )
    yank = Yank(at=row.yanked_at, by=row.yanked_by, reason=row.yank_reason) if row.yanked_at else None
    return Record(
        key=row.key,
        repo=f"{target.owner}/{target.name}",
        manifest=manifest,
        input_contract=row.input_contract,
        binding_table=[Binding(**b) for b in row.binding_table],
        kernel_lane=row.kernel_lane,
        publisher=Publisher(principal=row.publisher, jti=row.publisher_jti),
        created_at=row.created_at,
        health=row.health,
        yank=yank,
        receipt=row.receipt,
        binding_signature=row.binding_signature,
        drift_reports=row.drift_reports,
    )


ACTION_YANK = "compiled_graph.yank"


def yank(
    ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str, reason: str, publisher: str | None = None
) -> Record:
    """Admin only: one live record stops resolving (kept for audit); the key may be published again.

    The record is named by key and ``publisher`` (``access`` "Yanking"); the
    answer is that record, so it says exactly what was yanked.
    """
    validate_owner(owner)
    validate_repo(repo)
    with ctx.db.session() as session:
        yank_decision(session, claims, owner, repo).enforce()
        target = find_repo(session, owner, repo)
        live = _yank_target(session, claims, target, key, publisher) if target is not None and is_key(key) else None
        if live is None:
            raise NameUnknown("no such compiled graph", key=key[:120])
        now = utcnow()
        session.execute(
            update(CompiledGraph)
            .where(CompiledGraph.id == live.id)
            .values(yanked_at=now, yanked_by=claims.sub, yank_reason=reason)
        )
        live.yanked_at, live.yanked_by, live.yank_reason = now, claims.sub, reason
        audit(
            session,
            actor=claims.sub,
            jti=claims.jti,
            action=ACTION_YANK,
            target=f"{owner}/{repo}:{key}",
            repo=f"{owner}/{repo}",
            detail={"reason": reason, "artifact": live.artifact_digest, "publisher": live.publisher},
        )
        events.yanked(session, ctx.feed, target, live, reason)  # the feed's lock: last, after the audit's
        components = components_of(session, [live.id])
    return to_record(target, live, components.get(live.id, []))


def _yank_target(
    session: Session, claims: Claims, target: Repo, key: str, publisher: str | None
) -> CompiledGraph | None:
    """The one live record a yank addresses: ``publisher``'s (in a private cache, default the caller's)."""
    whose = publisher or access.private_reader(claims, target.visibility)
    query = live_query(target.id, key)
    rows = list(session.scalars(query if whose is None else query.where(CompiledGraph.publisher == whose)))
    publishers = sorted({row.publisher for row in rows})
    if len(publishers) > 1:  # only after a visibility change: several tenants' records of one key
        raise Conflict(
            "several publishers hold a live record of this key: name one with 'publisher'",
            key=key,
            publishers=publishers,
        )
    return rows[0] if rows else None  # one publisher's several (a visibility change too): the oldest
