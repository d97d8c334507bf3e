"""The compiled-graphs capability: publish (write-once), read, list, yank, batch resolve, discover, drift reports.

Publish runs admission (``admission.py``) outside any transaction, then one
short transaction inserts the record if the key has no live record, with its
components, its receipt (``receipts.py``: signed in that transaction, so a key
retirement never slips between signature and record) and its audit entry. Never
last-writer-wins: ``INSERT ... ON CONFLICT DO NOTHING`` against the partial
unique index decides one winner among racing publishes; the others compare
with the winner (same artifact and same components: 200, else 409
``KEY_CONFLICT``, audited as a non-reproducible mint). In a private cache the
write-once scope is the publisher's own (``models.py``), so one tenant's
publish never learns of another's record. Nothing is written before admission
passed, and the record only names blobs whose rows exist (foreign keys), so a
record never points at bytes the database does not hold.

Resolve answers up to ``MAX_RESOLVE_KEYS`` keys in three SQL statements
whatever the count: the search plan (the repos the token searches, ranked, and
whose records each shows: ``access.searched_repos``), the best record per key
among the live records of those repos only, and the chosen ones' components.
Records the caller cannot read are never touched, so neither the answer nor
its duration says anything about them; a miss is identical for an absent,
yanked, unhealthy or unreadable key.

Discover (issue 16) is resolve by declaration instead of by key: the records
whose ``discovery_digest`` (stored at publish) is the declaration's, through
the same plan, visibility and ranking, the first ``limit`` chosen in SQL; a
miss asked to explain itself is explained by ``explain.py`` from readable
records only. A drift report counts a worker's disagreement on a readable
record and audits it, rate-limited per principal and per record over the audit
log.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pydantic_core import to_json
from sqlalchemy import ColumnElement, case, delete, exists, func, literal_column, or_, select, union_all, update
from sqlalchemy.orm import Session

from cgstore import access
from cgstore.audit.denials import audit_refusal
from cgstore.audit.models import ACTOR_LEN, TARGET_LEN, AuditEvent
from cgstore.audit.service import DETAIL_STRING_LEN, clean
from cgstore.audit.service import record as audit
from cgstore.blobs.models import Blob
from cgstore.blobs.service import held_blobs, hold_blobs
from cgstore.compiled_graphs import admission, explain, receipts
from cgstore.compiled_graphs.models import HEALTH_OK, CompiledGraph, CompiledGraphComponent
from cgstore.context import StoreContext
from cgstore.core.cursors import CURSOR_LEN
from cgstore.core.db import in_values, utcnow
from cgstore.core.errors import (
    BlobReferenceUnknown,
    Conflict,
    KeyConflict,
    KeyInvalid,
    MetadataInvalid,
    NameUnknown,
    RateLimited,
    SizeInvalid,
    StoreError,
    Unavailable,
    maybe_hidden_miss,
)
from cgstore.core.faults import crash_point
from cgstore.core.names import validate_owner, validate_repo
from cgstore.core.private import private_dir
from cgstore.repos.models import Repo
from cgstore.repos.service import find_repo, readable_repo, write_decision, yank_decision
from cgstore.tokens.claims import Claims
from cgstore_client.binding import is_binding_signature, signature_from_table
from cgstore_client.components import ComponentHeader
from cgstore_client.keys import is_key
from cgstore_client.wire.discovery import DiscoverRequest, DriftReport
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
    PublishAnswer,
    Publisher,
    Record,
    RecordPage,
    ResolveRequest,
    ToolchainAxis,
    Yank,
)

ACTION_PUBLISH = "compiled_graph.publish"
#: Statuses of a publish refused for what it sent (KEY_MISMATCH, ARTIFACT_INVALID, METADATA_INVALID, …).
REFUSED_INPUT_STATUSES = (400, 422)
ACTION_YANK = "compiled_graph.yank"
ACTION_REPORT = "compiled_graph.report"

#: A blob of a repo: ``(owner, repo, digest)``.
BlobRef = tuple[str, str, str]
#: Download URLs for many blobs at once (presigning is batched): ``[ref, ...] -> {ref: url}``.
UrlsFor = Callable[[list[BlobRef]], dict[BlobRef, str]]


@dataclasses.dataclass(frozen=True)
class Published:
    answer: PublishAnswer
    created: bool


# -- publish -------------------------------------------------------------------------------


def publish(ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str, manifest: Manifest) -> Published:
    """Admit ``manifest`` and insert it under ``key`` unless the key already has a live record."""
    try:
        published = _publish(ctx, claims, owner, repo, key, manifest)
    except KeyConflict:
        ctx.metrics.publishes.labels("conflict", KeyConflict.code).inc()
        raise
    except StoreError as err:
        ctx.metrics.publishes.labels("refused", err.code).inc()
        if err.status in REFUSED_INPUT_STATUSES:
            # 401/403/hidden 404s are audited by the error handler; a refused manifest only here.
            audit_refusal(ctx.db, ctx.denials, actor=claims.sub, jti=claims.jti, action=ACTION_PUBLISH,
                          target=f"{owner}/{repo}:{key}", repo=f"{owner}/{repo}", err=err)
        raise
    ctx.metrics.publishes.labels(published.answer.status, "").inc()
    return published


def _publish(ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str, manifest: Manifest) -> Published:
    with ctx.db.session() as session:
        write_decision(session, claims, owner, repo).enforce()
    derived = admission.check_manifest(key, manifest)
    with ctx.db.session() as session:
        target = find_repo(session, owner, repo)
        sizes = _linked_sizes(session, claims, target, manifest)
    report = admission.inspect_stored(
        ctx.storage.read(manifest.artifact.digest),
        sizes[manifest.artifact.digest],
        spool_dir=str(private_dir(ctx.settings.spool_dir)),
    )
    admission.check_archive(report, manifest)
    headers = _component_headers(ctx, manifest)
    bindings = admission.bind(report, headers)
    row = _new_row(target, key, manifest, derived, report, bindings, claims)
    return _insert_if_absent(ctx, claims, target, row, manifest)


def _linked_sizes(session: Session, claims: Claims, target: Repo | None, manifest: Manifest) -> dict[str, int]:
    """Sizes of the artifact and components linked in the repo; any absent: ``BLOB_UNKNOWN`` (400).

    In a private cache only the caller's own blobs count: a record must never
    point a reader at bytes another principal uploaded.
    """
    wanted = {manifest.artifact.digest: manifest.artifact.size}
    wanted.update({c.digest: c.size for c in manifest.components})
    linked: dict[str, int] = {}
    if target is not None:
        linked = dict(session.execute(held_blobs(claims, target, list(wanted))).all())
    missing = [d for d in wanted if d not in linked]
    if missing:
        raise BlobReferenceUnknown("the manifest names blobs this repo does not hold", missing=missing)
    wrong = {d: {"manifest": wanted[d], "stored": linked[d]} for d in wanted if wanted[d] != linked[d]}
    if wrong:
        raise SizeInvalid("the manifest's sizes differ from the stored blobs'", sizes=wrong)
    return linked


def _component_headers(ctx: StoreContext, manifest: Manifest) -> dict[str, ComponentHeader]:
    return {
        component.name: admission.component_header(
            component.name, lambda start, end, d=component.digest: ctx.storage.read(d, start, end), component.size
        )
        for component in manifest.components
    }


def _new_row(
    target: Repo, key: str, manifest: Manifest, derived: admission.Derived, report, bindings, claims: Claims
) -> CompiledGraph:
    layout = manifest.layout
    return CompiledGraph(
        repo_id=target.id,
        key=key,
        kind=manifest.kind,
        format=manifest.format,
        family=manifest.family,
        lane=manifest.lane,
        sm=manifest.axes.sm,
        graph_digest=report.graph_digest,
        envelope=derived.envelope.document,
        envelope_digest=derived.envelope.digest,
        toolchain=derived.toolchain.document,
        toolchain_digest=derived.toolchain.digest,
        recorded_versions=dict(derived.toolchain.recorded),
        artifact_digest=manifest.artifact.digest,
        artifact_size=manifest.artifact.size,
        component_set=admission.component_set_digest(_component_tuples(manifest.components)),
        layout_display=layout.display if layout else None,
        layout_topology=layout.topology if layout else None,
        layout_quant=layout.quant if layout else None,
        input_contract=report.input_contract,
        binding_table=bindings,
        kernel_lane=report.metadata.to_document().get("kernel_lane"),
        kernel_lane_evidence=manifest.evidence.kernel_lane_evidence,
        mint_phases=manifest.evidence.mint_phases,
        publisher=claims.sub,
        publisher_jti=claims.jti,
        scope=access.private_reader(claims, target.visibility) or "",
        created_at=utcnow(),
        health=HEALTH_OK,
        discovery_digest=admission.discovery_of(manifest.family, manifest.axes.sm, derived),
        binding_signature=signature_from_table(report.binding_table, report.metadata.ties),
        release=manifest.release,
        code_fingerprint=manifest.code,
        drift_reports=0,
    )


def _component_tuples(components: Iterable[ComponentRef]) -> list[tuple[str, str, int]]:
    return [(c.name, c.digest, c.size) for c in components]


#: Insert attempts when the record that blocked an insert is yanked before it can be read.
_INSERT_ATTEMPTS = 3


def _insert_if_absent(
    ctx: StoreContext, claims: Claims, target: Repo, row: CompiledGraph, manifest: Manifest
) -> Published:
    crash_point("publish.admitted")
    for _ in range(_INSERT_ATTEMPTS):
        published = _try_insert(ctx, claims, target, row, manifest)
        if published is not None:
            crash_point("publish.committed")
            return published
    raise Unavailable("the key's live record kept changing during this publish; retry")


def _try_insert(
    ctx: StoreContext, claims: Claims, target: Repo, row: CompiledGraph, manifest: Manifest
) -> Published | None:
    """Insert, or compare with the live record that blocked the insert; None if that record vanished (yanked)."""
    repo_name = f"{target.owner}/{target.name}"
    target_name = f"{repo_name}:{row.key}"
    values = {c.key: getattr(row, c.key) for c in CompiledGraph.__table__.columns if c.key != "id"}
    with ctx.db.session() as session:
        # The write comes first: SQLite takes its write lock here (no read-then-upgrade
        # race), PostgreSQL waits for a concurrent inserter of the same key to finish.
        record_id = session.execute(_insert_ignoring_live_conflict(session).values(**values).returning(
            CompiledGraph.id)).scalar()
        if record_id is not None:
            # Signed here, after the write: a key's retirement cannot commit between this
            # signature and the record's (receipts.py), so its re-signing never misses it.
            _stamp(ctx, session, target, row, manifest)
            session.execute(update(CompiledGraph).where(CompiledGraph.id == record_id)
                            .values(receipt=row.receipt, receipt_kid=row.receipt_kid))
            # In this transaction, so that GC either sees the record's blobs linked now or
            # had condemned them first: then the publish is refused and the insert rolled back.
            condemned = hold_blobs(session, [row.artifact_digest, *(c.digest for c in manifest.components)])
            if condemned:
                raise BlobReferenceUnknown("the manifest names blobs being garbage-collected", missing=sorted(condemned))
            session.add_all(
                CompiledGraphComponent(record_id=record_id, name=c.name, digest=c.digest, size=c.size)
                for c in manifest.components
            )
            audit(session, actor=claims.sub, jti=claims.jti, action=ACTION_PUBLISH, target=target_name,
                  repo=repo_name, detail={"result": "created", "artifact": row.artifact_digest, "component_set": row.component_set})
            crash_point("publish.inserted")  # everything written, nothing committed
            return Published(_publish_answer(target, row, "created"), created=True)
        live = _live_record(session, target.id, row.key, row.scope)
        if live is None:
            return None
        same = live.artifact_digest == row.artifact_digest and live.component_set == row.component_set
        if same and live.receipt is None:  # published before receipts (revision 0007): vouch for it now
            _stamp(ctx, session, target, live, manifest)
        detail = {"live": {"artifact": live.artifact_digest, "component_set": live.component_set},
                  "offered": {"artifact": row.artifact_digest, "component_set": row.component_set}}
        audit(session, actor=claims.sub, jti=claims.jti, action=ACTION_PUBLISH, target=target_name,
              repo=repo_name, outcome="ok" if same else KeyConflict.code,
              detail={"result": "exists"} if same else {"result": "non-reproducible mint", **detail})
    if not same:
        raise KeyConflict(
            "this key already holds different bytes (a non-reproducible mint); records are never overwritten",
            key=row.key, **detail,
        )
    return Published(_publish_answer(target, live, "exists"), created=False)


def _stamp(ctx: StoreContext, session: Session, target: Repo, row: CompiledGraph, manifest: Manifest) -> None:
    """Sign ``row``'s receipt; ``manifest``'s components are the record's (the same component set)."""
    receipts.stamp(
        session, ctx.tokens.ring, issuer=ctx.settings.token_issuer, repo=f"{target.owner}/{target.name}", row=row,
        components=((c.name, c.digest) for c in manifest.components),
    )


def _insert_ignoring_live_conflict(session: Session):
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(CompiledGraph).on_conflict_do_nothing()


def _live(repo_id: int, key: str):
    """The live records of ``key`` in a repo, oldest first (several only in a private cache: one per publisher)."""
    return select(CompiledGraph).where(
        CompiledGraph.repo_id == repo_id, CompiledGraph.key == key, CompiledGraph.yanked_at.is_(None)
    ).order_by(CompiledGraph.id)


def _live_record(session: Session, repo_id: int, key: str, scope: str) -> CompiledGraph | None:
    """The live record of ``key`` in its write-once ``scope``."""
    return session.scalar(_live(repo_id, key).where(CompiledGraph.scope == scope))


def _publish_answer(target: Repo, row: CompiledGraph, status: str) -> PublishAnswer:
    return PublishAnswer(
        status=status, key=row.key, repo=f"{target.owner}/{target.name}",
        artifact=Artifact(digest=row.artifact_digest, size=row.artifact_size), receipt=row.receipt,
    )


# -- read, list ----------------------------------------------------------------------------


def _readable(session: Session, ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str | None) -> Repo:
    return readable_repo(session, claims, owner, repo, NameUnknown, "no such compiled graph",
                         **({"key": key[:120]} if key else {}))


def _visible(query, claims: Claims, target: Repo):
    """The private-cache rule (``access.private_reader``): only the reader's own records, when it applies."""
    reader = access.private_reader(claims, target.visibility)
    return query if reader is None else query.where(CompiledGraph.publisher == reader)


def get_record(ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str) -> Record:
    with ctx.db.session() as session:
        target, live = _readable_record(session, ctx, claims, owner, repo, key)
        components = _components_of(session, [live.id])
    return to_record(target, live, components.get(live.id, []))


def _readable_record(
    session: Session, ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str
) -> tuple[Repo, CompiledGraph]:
    """The live record of ``key`` the caller may read; else the one 404 an absent key gets."""
    target = _readable(session, ctx, claims, owner, repo, key)
    live = session.scalar(_visible(_live(target.id, key), claims, target).limit(1)) if is_key(key) else None
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
            CompiledGraph.repo_id == repo_id, CompiledGraph.key == key, CompiledGraph.publisher != reader,
            CompiledGraph.created_at <= at, or_(CompiledGraph.yanked_at.is_(None), CompiledGraph.yanked_at > at),
        )
        return session.scalar(live_then.limit(1)) is not None

    return maybe_hidden_miss(NameUnknown, "no such compiled graph", published_by_another, key=key[:120])


def list_records(
    ctx: StoreContext, claims: Claims, owner: str, repo: str, *,
    family: str | None, sm: str | None, lane: str | None, cursor: str | None, limit: int,
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
        filters = ((CompiledGraph.family, family), (CompiledGraph.sm, sm), (CompiledGraph.lane, lane),
                   (CompiledGraph.release, release))
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


def _records_of(
    session: Session, target: Repo, batches: Iterable[list[CompiledGraph]]
) -> Iterator[tuple[int, Record]]:
    """Each row's id and record, built one batch at a time (its components in one query) as the page asks."""
    for batch in batches:
        components = _components_of(session, [row.id for row in batch])
        for row in batch:
            yield row.id, to_record(target, row, components.get(row.id, []))


def cursor_scope(target: Repo) -> str:
    """What a listing cursor is sealed to: this repo's records (a repo made again has a new id)."""
    return f"compiled-graphs:{target.id}"


def _components_of(session: Session, record_ids: list[int]) -> dict[int, list[CompiledGraphComponent]]:
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
        if row.layout_display is not None else None
    )
    manifest = Manifest(
        kind=row.kind, format=row.format, family=row.family, lane=row.lane,
        axes=Axes(graph=row.graph_digest, envelope=row.envelope, sm=row.sm,
                  toolchain=ToolchainAxis(components=row.toolchain["components"], recorded=row.recorded_versions)),
        artifact=Artifact(digest=row.artifact_digest, size=row.artifact_size),
        components=[ComponentRef(name=c.name, digest=c.digest, size=c.size) for c in components],
        layout=layout,
        evidence=Evidence(kernel_lane_evidence=row.kernel_lane_evidence, mint_phases=row.mint_phases),
        release=row.release,
        code=row.code_fingerprint,
    )
    yank = Yank(at=row.yanked_at, by=row.yanked_by, reason=row.yank_reason) if row.yanked_at else None
    return Record(
        key=row.key, repo=f"{target.owner}/{target.name}", manifest=manifest,
        input_contract=row.input_contract, binding_table=[Binding(**b) for b in row.binding_table],
        kernel_lane=row.kernel_lane, publisher=Publisher(principal=row.publisher, jti=row.publisher_jti),
        created_at=row.created_at, health=row.health, yank=yank, receipt=row.receipt,
        binding_signature=row.binding_signature, drift_reports=row.drift_reports,
    )


# -- yank ----------------------------------------------------------------------------------


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
            update(CompiledGraph).where(CompiledGraph.id == live.id)
            .values(yanked_at=now, yanked_by=claims.sub, yank_reason=reason)
        )
        live.yanked_at, live.yanked_by, live.yank_reason = now, claims.sub, reason
        audit(session, actor=claims.sub, jti=claims.jti, action=ACTION_YANK, target=f"{owner}/{repo}:{key}",
              repo=f"{owner}/{repo}", detail={"reason": reason, "artifact": live.artifact_digest, "publisher": live.publisher})
        components = _components_of(session, [live.id])
    return to_record(target, live, components.get(live.id, []))


def _yank_target(
    session: Session, claims: Claims, target: Repo, key: str, publisher: str | None
) -> CompiledGraph | None:
    """The one live record a yank addresses: ``publisher``'s (in a private cache, default the caller's)."""
    whose = publisher or access.private_reader(claims, target.visibility)
    query = _live(target.id, key)
    rows = list(session.scalars(query if whose is None else query.where(CompiledGraph.publisher == whose)))
    publishers = sorted({row.publisher for row in rows})
    if len(publishers) > 1:  # only after a visibility change: several tenants' records of one key
        raise Conflict("several publishers hold a live record of this key: name one with 'publisher'",
                       key=key, publishers=publishers)
    return rows[0] if rows else None  # one publisher's several (a visibility change too): the oldest


# -- resolve -------------------------------------------------------------------------------

_RESOLVE_COLUMNS = (
    CompiledGraph.id, CompiledGraph.key, CompiledGraph.kind, CompiledGraph.format, CompiledGraph.family,
    CompiledGraph.lane, CompiledGraph.sm, CompiledGraph.graph_digest, CompiledGraph.envelope_digest,
    CompiledGraph.toolchain_digest, CompiledGraph.layout_display, CompiledGraph.layout_topology,
    CompiledGraph.layout_quant, CompiledGraph.created_at, CompiledGraph.artifact_digest,
    CompiledGraph.artifact_size, CompiledGraph.receipt, CompiledGraph.repo_id,
)


def resolve(ctx: StoreContext, claims: Claims, request: ResolveRequest, urls_for: UrlsFor) -> bytes:
    """One answer per requested key, in order: the best readable live record, or a miss.

    Returns the ``ResolveAnswer`` JSON itself (see ``_answer``).
    """
    for key in request.keys:
        if not is_key(key):
            raise KeyInvalid("not a valid key", key=key[:120])
    with ctx.db.session() as session:
        searched = _search_plan(session, claims)
        best: dict[str, Any] = {}
        if searched:
            # Column rows through Core (the session's connection): the ORM's result
            # machinery has nothing to add to plain columns and cost a tenth of a resolve.
            best = {row.key: row for row in session.connection().execute(_best_per_key(session, searched, (
                in_values(session, CompiledGraph.key, sorted(set(request.keys))),
                CompiledGraph.family == request.family,
            ), _RESOLVE_COLUMNS))}
        components = _component_rows(session, [row.id for row in best.values()])
    repos = {repo.id: repo for repo in searched}
    urls = urls_for(_blob_refs(best.values(), repos, components))
    hits = {key: _answer(key, row, repos, components, urls) for key, row in best.items()}
    answers = [hits.get(key) or {"key": key, "status": "miss"} for key in request.keys]
    hit_count = sum(1 for key in request.keys if key in hits)
    ctx.metrics.count_resolve(request.family, hit_count, len(answers) - hit_count)
    # Serialized once, in pydantic-core, from plain data built in the wire types'
    # field order: validating 128 hits into models only to dump them again was a
    # fifth of a resolve's CPU. tests/compiled_graphs/test_resolve_api.py checks
    # the bytes are exactly what ``ResolveAnswer`` itself serializes.
    return to_json({"answers": answers})


def _search_plan(session: Session, claims: Claims) -> list[access.SearchedRepo]:
    """The repos a resolve or discover by ``claims`` searches, best first (``access.searched_repos``).

    Read from the repos the caller can be searching at all
    (``access.search_candidates``), so other tenants' repos, however many, are never read.
    """
    return access.searched_repos(claims, session.connection().execute(access.search_candidates(claims)))


def _best_per_key(
    session: Session, searched: list[access.SearchedRepo], match: tuple, columns: tuple, *, limit: int | None = None
):
    """The statement of ``columns`` of the best live, healthy record per key among ``match``es in ``searched``.

    Only rows the caller may read are ever touched: each searched repo's are
    found through the index led by ``match``'s columns then ``(repo_id,
    publisher)`` (``models.py``), in a private cache only the reader's own. The
    best of a key is the record of the first searched repo, then the lowest id
    (``access`` "Resolving"). With ``limit``: the first ``limit`` of them by
    their repo's rank, then newest first (discover's order). The choosing
    reads ids only; the records' columns are read for the chosen ones.
    """
    rank = _per_repo(searched, "rank").label("search_rank")
    position = _per_repo(searched, "position").label("search_position")
    branches = []
    # One branch per reader (shared repos; private caches), each an index range the database can seek.
    for reader in sorted({repo.reader for repo in searched}, key=lambda reader: reader or ""):
        readable = access.readable_in([repo for repo in searched if repo.reader == reader],
                                      CompiledGraph.repo_id, CompiledGraph.publisher)
        branches.append(
            select(CompiledGraph.id, CompiledGraph.key, rank, position)
            # The artifact's blob row must exist: a record never resolves to bytes the database lacks.
            # (No join to repos: the plan knows each searched repo's owner and name.)
            .join(Blob, Blob.digest == CompiledGraph.artifact_digest)
            .where(*match, readable, CompiledGraph.yanked_at.is_(None), CompiledGraph.health == HEALTH_OK)
        )
    if len(branches) == 1:
        nth = func.row_number().over(partition_by=CompiledGraph.key, order_by=(position, CompiledGraph.id))
        ranked = branches[0].add_columns(nth.label("nth")).subquery("ranked")
    else:  # shared repos and private caches: one window over both
        rows = union_all(*branches).subquery("candidates")
        nth = func.row_number().over(partition_by=rows.c.key, order_by=(rows.c.search_position, rows.c.id))
        ranked = select(rows.c.id, rows.c.search_rank, nth.label("nth")).subquery("ranked")
    chosen = (select(*columns, ranked.c.search_rank).join(ranked, ranked.c.id == CompiledGraph.id)
              .where(ranked.c.nth == 1))
    if limit is None:
        return chosen
    return chosen.order_by(ranked.c.search_rank, CompiledGraph.id.desc()).limit(limit)


def _per_repo(searched: list[access.SearchedRepo], field: str):
    """SQL: a searched repo's ``field`` by the record's repo id.

    Integers the plan computed, rendered inline: typed as integers on both
    databases, and no bound parameters beyond the repo ids' own.
    """
    return case({literal_column(str(int(repo.id))): literal_column(str(int(getattr(repo, field))))
                 for repo in searched}, value=CompiledGraph.repo_id)


def _component_rows(session: Session, record_ids: list[int]) -> dict[int, list[tuple[str, str, int]]]:
    """``(name, digest, size)`` of the chosen records' components: always one statement."""
    by_record: dict[int, list[tuple[str, str, int]]] = {}
    rows = session.connection().execute(
        select(CompiledGraphComponent.record_id, CompiledGraphComponent.name, CompiledGraphComponent.digest,
               CompiledGraphComponent.size)
        .join(Blob, Blob.digest == CompiledGraphComponent.digest)
        # A bound array on PostgreSQL (constant statement text): an expanding IN of
        # 128 ids was re-rendered and re-split by the driver on every resolve.
        .where(in_values(session, CompiledGraphComponent.record_id, record_ids))
        .order_by(CompiledGraphComponent.record_id, CompiledGraphComponent.name)
    )
    for record_id, name, digest, size in rows:
        by_record.setdefault(record_id, []).append((name, digest, size))
    return by_record


#: The searched repos by id (``_search_plan``): a found row's owner and name, known before any record was read.
SearchedById = dict[int, access.SearchedRepo]


def _blob_refs(rows: Iterable, repos: SearchedById, components: dict[int, list[tuple[str, str, int]]]) -> list[BlobRef]:
    refs = []
    for row in rows:
        owner, name = repos[row.repo_id].owner, repos[row.repo_id].name
        refs.append((owner, name, row.artifact_digest))
        refs += [(owner, name, digest) for _, digest, _ in components.get(row.id, [])]
    return refs


def _answer(
    key: str, row, repos: SearchedById, components: dict[int, list[tuple[str, str, int]]], urls: dict[BlobRef, str]
) -> dict:
    """One hit as plain data, keys in the wire types' field order (``ResolveHit``, ``ComponentDownload``).

    ``row`` starts with ``_RESOLVE_COLUMNS`` (discover's rows carry more after them).
    """
    (record_id, record_key, kind, format_, family, lane, sm, graph, envelope_digest, toolchain_digest,
     layout_display, layout_topology, layout_quant, created_at, artifact_digest, artifact_size, receipt,
     repo_id) = row[:len(_RESOLVE_COLUMNS)]
    owner, name = repos[repo_id].owner, repos[repo_id].name
    layout = None
    if layout_display is not None:
        layout = {"display": layout_display, "topology": layout_topology, "quant": layout_quant}
    return {
        "key": key,
        "status": "hit",
        "repo": f"{owner}/{name}",
        "record": {
            "kind": kind, "format": format_, "family": family, "lane": lane, "sm": sm,
            "graph": graph, "envelope_digest": envelope_digest,
            "toolchain_digest": toolchain_digest, "layout": layout,
            "created_at": created_at, "href": f"/v1/repos/{owner}/{name}/compiled-graphs/{record_key}",
        },
        "artifact": {"digest": artifact_digest, "size": artifact_size,
                     "url": urls[(owner, name, artifact_digest)]},
        "components": [
            {"digest": digest, "size": size, "url": urls[(owner, name, digest)], "name": component_name}
            for component_name, digest, size in components.get(record_id, [])
        ],
        "receipt": receipt,
    }


# -- discover --------------------------------------------------------------------------------


def discover(ctx: StoreContext, claims: Claims, request: DiscoverRequest, urls_for: UrlsFor) -> bytes:
    """The live records matching a declaration, best first, in resolve's hit shape; the answer's JSON.

    Visibility and ranking are resolve's (``_best_per_key``): per key the
    best-ranked readable record, then keys ordered by that rank, newest first,
    at most ``limit``, all decided in SQL over the rows the caller may read.
    Three statements whatever the table holds (the search plan, the records
    through ``ix_compiled_graphs_discover``, the chosen ones' components); an
    answer with nothing readable is the same bytes as one with nothing at all.
    """
    admission.check_family(request.family)
    derived = admission.derive_axes(request.envelope, request.sm, request.toolchain)
    admission.check_release(request.release)
    admission.check_code(request.code)
    if request.binding_signature is not None and not is_binding_signature(request.binding_signature):
        raise MetadataInvalid("binding_signature must be 'bs1:' + 64 lowercase hex (cgstore_client.binding)",
                              binding_signature=request.binding_signature)
    digest = admission.discovery_of(request.family, request.sm, derived)
    with ctx.db.session() as session:
        searched = _search_plan(session, claims)
        chosen = []
        if searched:
            chosen = session.connection().execute(_best_per_key(
                session, searched, _discover_match(request, digest),
                (*_RESOLVE_COLUMNS, CompiledGraph.binding_signature, CompiledGraph.release), limit=request.limit,
            )).all()
        components = _component_rows(session, [row.id for row in chosen])
        miss = explain.explain_miss(session, claims, request, derived, searched) if request.explain and not chosen \
            else None
    repos = {repo.id: repo for repo in searched}
    urls = urls_for(_blob_refs(chosen, repos, components))
    found = [{**_answer(row.key, row, repos, components, urls), "binding_signature": row.binding_signature,
              "release": row.release} for row in chosen]
    answer: dict[str, Any] = {"candidates": found}  # built in ``DiscoverAnswer``'s field order, as resolve's is
    if miss is not None:
        answer["miss"] = miss.model_dump(mode="json")
    return to_json(answer)


def _discover_match(request: DiscoverRequest, digest: str) -> tuple:
    """What a record must have to match ``request`` (its discovery ``digest``, then the optional filters)."""
    match = [CompiledGraph.discovery_digest == digest]
    if request.release is not None:
        match.append(CompiledGraph.release == request.release)
    if request.binding_signature is not None:
        match.append(CompiledGraph.binding_signature == request.binding_signature)
    if request.code is not None:  # only records that recorded their code can differ from it
        match.append(or_(CompiledGraph.code_fingerprint.is_(None), CompiledGraph.code_fingerprint == request.code))
    return tuple(match)


# -- drift reports ------------------------------------------------------------------------------

#: Drift reports one principal may make per ``REPORT_WINDOW_S``, over all its tokens (beyond: 429, ``Retry-After``).
REPORTS_PER_WINDOW = 10
#: Drift reports one record may receive per ``REPORT_WINDOW_S``, from all principals together.
REPORTS_PER_RECORD = 3
REPORT_WINDOW_S = 60
#: Longest drift-report reason (a diagnostic line: the client's names two graph digests in about 190).
MAX_REPORT_REASON_CHARS = 256


def report_drift(
    ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str, report: DriftReport
) -> Record:
    """Count a worker's report that the record's graph is not its live model; audited, never yanks.

    Any token that can read the record may report (others get the 404 an absent
    key gets). Two limits count the report entries in the audit log, after
    appending this one: the principal's (``sub``: attenuation keeps it, so a
    token's children share their root's count) and the record's. Appends are
    serialized by the chain head, so racing reports cannot all slip under a
    limit, and a refused one leaves nothing (its transaction rolls back).
    """
    if len(report.reason) > MAX_REPORT_REASON_CHARS:
        raise MetadataInvalid(f"reason is longer than {MAX_REPORT_REASON_CHARS} characters",
                              field="reason", limit=MAX_REPORT_REASON_CHARS)
    target_name = f"{owner}/{repo}:{key}"
    with ctx.db.session() as session:
        target, live = _readable_record(session, ctx, claims, owner, repo, key)
        session.execute(update(CompiledGraph).where(CompiledGraph.id == live.id)
                        .values(drift_reports=CompiledGraph.drift_reports + 1))
        audit(session, actor=claims.sub, jti=claims.jti, action=ACTION_REPORT, target=target_name,
              repo=f"{owner}/{repo}",
              detail={"measured_graph": report.measured_graph, "reason": report.reason,
                      "graph": live.graph_digest, "publisher": live.publisher})
        _within_report_limits(session, claims, target_name, live.publisher)
        session.refresh(live)
        components = _components_of(session, [live.id])
    return to_record(target, live, components.get(live.id, []))


def _within_report_limits(session: Session, claims: Claims, target: str, publisher: str) -> None:
    """The principal's limit, then the record's; each counted over the audit log's last ``REPORT_WINDOW_S``.

    Entries are matched in their stored form (``audit.service.clean``). A record
    is its audit target and its publisher: in a private cache each publisher's
    record of a key is its own, so one tenant's reports never count against, or
    reveal, another's record of the same key.
    """
    since = utcnow() - dt.timedelta(seconds=REPORT_WINDOW_S)
    reports = (AuditEvent.action == ACTION_REPORT, AuditEvent.at >= since)
    by_principal = AuditEvent.actor == clean(claims.sub, ACTOR_LEN)
    on_record = (AuditEvent.target == clean(target, TARGET_LEN),
                 AuditEvent.detail["publisher"].as_string() == clean(publisher, DETAIL_STRING_LEN))
    limits = (((by_principal,), REPORTS_PER_WINDOW, "principal"), (on_record, REPORTS_PER_RECORD, "record"))
    for where, limit, per in limits:
        made, oldest = session.execute(select(func.count(), func.min(AuditEvent.at)).where(*reports, *where)).one()
        if made > limit:
            wait = REPORT_WINDOW_S - (utcnow() - oldest).total_seconds()
            raise RateLimited(f"at most {limit} drift reports per {per} per {REPORT_WINDOW_S} s",
                              retry_after_s=max(1, math.ceil(wait)), limit=limit, per=per)


# -- garbage collection's view of records -----------------------------------------------------


def blob_kept_by_records(cutoff: dt.datetime) -> ColumnElement[bool]:
    """GC keeper (``operations.gc.KEEPERS``): a live record, or one yanked since ``cutoff``, names the blob."""
    counts = or_(CompiledGraph.yanked_at.is_(None), CompiledGraph.yanked_at >= cutoff)
    as_artifact = exists().where(CompiledGraph.artifact_digest == Blob.digest, counts)
    as_component = exists().where(
        CompiledGraphComponent.digest == Blob.digest, CompiledGraphComponent.record_id == CompiledGraph.id, counts
    )
    return or_(as_artifact, as_component)


def forget_yanked_records(session: Session, digests: list[str]) -> int:
    """Before GC deletes blob rows: the long-yanked records naming them go too; returns how many.

    Only yanked records can name a condemned blob (a live one keeps it), and the
    audit log keeps their history. A live record here would make the blob
    delete fail on its foreign key, loudly, rather than lose a record's bytes.
    """
    named = select(CompiledGraphComponent.record_id).where(CompiledGraphComponent.digest.in_(digests))
    ids = list(
        session.scalars(
            select(CompiledGraph.id).where(
                CompiledGraph.yanked_at.is_not(None),
                or_(CompiledGraph.artifact_digest.in_(digests), CompiledGraph.id.in_(named)),
            )
        )
    )
    if ids:
        session.execute(delete(CompiledGraphComponent).where(CompiledGraphComponent.record_id.in_(ids)))
        session.execute(delete(CompiledGraph).where(CompiledGraph.id.in_(ids)))
    return len(ids)
