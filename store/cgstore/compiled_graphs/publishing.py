"""Publish a compiled-graph record: write-once, admitted statically, receipted and audited in one transaction.

Admission (``admission.py``) runs outside any transaction; then one short
transaction inserts the record if the key has no live record, with its
components, its receipt (``receipts.py``: signed in that transaction, so a key
retirement never slips between signature and record) and its audit entry. Never
last-writer-wins: ``INSERT ... ON CONFLICT DO NOTHING`` against the partial
unique index decides one winner among racing publishes; the others compare
with the winner (same artifact and same components: 200, else 409
``KEY_CONFLICT``, audited as a non-reproducible mint). In a private cache the
write-once scope is the publisher's own (``models.py``), so one tenant's
publish never learns of another's record. Nothing is written before admission
passed, and the record only names blobs whose rows exist (foreign keys).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from cgstore import access
from cgstore.audit.denials import audit_refusal
from cgstore.audit.service import record as audit
from cgstore.blobs.service import held_blobs, hold_blobs
from cgstore.claims import service as claims_service
from cgstore.compiled_graphs import admission, events, receipts
from cgstore.compiled_graphs.models import HEALTH_OK, CompiledGraph, CompiledGraphComponent
from cgstore.context import StoreContext
from cgstore.core.db import utcnow
from cgstore.core.errors import (
    BlobReferenceUnknown,
    KeyConflict,
    SizeInvalid,
    StoreError,
    Unavailable,
)
from cgstore.core.faults import crash_point
from cgstore.core.private import private_dir
from cgstore.repos.models import Repo
from cgstore.repos.service import find_repo, write_decision
from cgstore.tokens.claims import Claims
from cgstore_client.binding import signature_from_table
from cgstore_client.components import ComponentHeader
from cgstore_client.wire.records import (
    Artifact,
    ComponentRef,
    Manifest,
    PublishAnswer,
)

ACTION_PUBLISH = "compiled_graph.publish"


#: Statuses of a publish refused for what it sent (KEY_MISMATCH, ARTIFACT_INVALID, METADATA_INVALID, …).
REFUSED_INPUT_STATUSES = (400, 422)


@dataclasses.dataclass(frozen=True)
class Published:
    answer: PublishAnswer
    created: bool


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
            audit_refusal(
                ctx.db,
                ctx.denials,
                actor=claims.sub,
                jti=claims.jti,
                action=ACTION_PUBLISH,
                target=f"{owner}/{repo}:{key}",
                repo=f"{owner}/{repo}",
                err=err,
            )
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
        lambda start, end: ctx.storage.read(manifest.artifact.digest, start, end),
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
        record_id = session.execute(
            _insert_ignoring_live_conflict(session).values(**values).returning(CompiledGraph.id)
        ).scalar()
        if record_id is not None:
            # Signed here, after the write: a key's retirement cannot commit between this
            # signature and the record's (receipts.py), so its re-signing never misses it.
            _stamp(ctx, session, target, row, manifest)
            session.execute(
                update(CompiledGraph)
                .where(CompiledGraph.id == record_id)
                .values(receipt=row.receipt, receipt_kid=row.receipt_kid)
            )
            # In this transaction, so that GC either sees the record's blobs linked now or
            # had condemned them first: then the publish is refused and the insert rolled back.
            condemned = hold_blobs(session, [row.artifact_digest, *(c.digest for c in manifest.components)])
            if condemned:
                raise BlobReferenceUnknown(
                    "the manifest names blobs being garbage-collected", missing=sorted(condemned)
                )
            session.add_all(
                CompiledGraphComponent(record_id=record_id, name=c.name, digest=c.digest, size=c.size)
                for c in manifest.components
            )
            # The publisher's own claim on this declaration ends with the record (same transaction).
            claims_service.release_by_publish(ctx, session, claims, repo_name, row)
            audit(
                session,
                actor=claims.sub,
                jti=claims.jti,
                action=ACTION_PUBLISH,
                target=target_name,
                repo=repo_name,
                detail={"result": "created", "artifact": row.artifact_digest, "component_set": row.component_set},
            )
            events.published(session, ctx.feed, target, row)  # the feed's lock: last, after the audit's
            crash_point("publish.inserted")  # everything written, nothing committed
            return Published(_publish_answer(target, row, "created"), created=True)
        live = _live_record(session, target.id, row.key, row.scope)
        if live is None:
            return None
        same = live.artifact_digest == row.artifact_digest and live.component_set == row.component_set
        if same and live.receipt is None:  # published before receipts (revision 0007): vouch for it now
            _stamp(ctx, session, target, live, manifest)
        detail = {
            "live": {"artifact": live.artifact_digest, "component_set": live.component_set},
            "offered": {"artifact": row.artifact_digest, "component_set": row.component_set},
        }
        audit(
            session,
            actor=claims.sub,
            jti=claims.jti,
            action=ACTION_PUBLISH,
            target=target_name,
            repo=repo_name,
            outcome="ok" if same else KeyConflict.code,
            detail={"result": "exists"} if same else {"result": "non-reproducible mint", **detail},
        )
    if not same:
        raise KeyConflict(
            "this key already holds different bytes (a non-reproducible mint); records are never overwritten",
            key=row.key,
            **detail,
        )
    return Published(_publish_answer(target, live, "exists"), created=False)


def _stamp(ctx: StoreContext, session: Session, target: Repo, row: CompiledGraph, manifest: Manifest) -> None:
    """Sign ``row``'s receipt; ``manifest``'s components are the record's (the same component set)."""
    receipts.stamp(
        session,
        ctx.tokens.ring,
        issuer=ctx.settings.token_issuer,
        repo=f"{target.owner}/{target.name}",
        row=row,
        components=((c.name, c.digest) for c in manifest.components),
    )


def _insert_ignoring_live_conflict(session: Session):
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(CompiledGraph).on_conflict_do_nothing()


def live_query(repo_id: int, key: str):
    """The live records of ``key`` in a repo, oldest first (several only in a private cache: one per publisher)."""
    return (
        select(CompiledGraph)
        .where(CompiledGraph.repo_id == repo_id, CompiledGraph.key == key, CompiledGraph.yanked_at.is_(None))
        .order_by(CompiledGraph.id)
    )


def _live_record(session: Session, repo_id: int, key: str, scope: str) -> CompiledGraph | None:
    """The live record of ``key`` in its write-once ``scope``."""
    return session.scalar(live_query(repo_id, key).where(CompiledGraph.scope == scope))


def _publish_answer(target: Repo, row: CompiledGraph, status: str) -> PublishAnswer:
    return PublishAnswer(
        status=status,
        key=row.key,
        repo=f"{target.owner}/{target.name}",
        artifact=Artifact(digest=row.artifact_digest, size=row.artifact_size),
        receipt=row.receipt,
    )
