"""Health: a blob's state, and the state of every compiled-graph record that binds it.

A record is as healthy as its worst blob (artifact or component): one missing
blob makes it ``blob_missing``, else one corrupt blob ``blob_corrupt``, else
``ok``. Resolve returns only ``ok`` records, so marking a blob damaged takes
every record using it out of service at once, and a verified re-upload (or a
scrub that finds the bytes intact again) puts back exactly the records whose
blobs are all intact. Every change is written in the caller's transaction,
with its audit entry.
"""

from __future__ import annotations

from sqlalchemy import select, union, update
from sqlalchemy.orm import Session

from cgstore.audit.service import record as audit
from cgstore.blobs.models import BLOB_CORRUPT, BLOB_MISSING, BLOB_OK, Blob
from cgstore.compiled_graphs.models import HEALTH_OK, CompiledGraph, CompiledGraphComponent

#: A blob's state → the state it gives a record binding it, worst first.
_RECORD_STATE = {BLOB_MISSING: "blob_missing", BLOB_CORRUPT: "blob_corrupt"}


def set_blob_health(
    session: Session, digest: str, health: str, *, actor: str, jti: str | None = None, detail: dict | None = None
) -> int | None:
    """Record what the bytes of ``digest`` were found to be; returns how many records changed state.

    None, and no audit entry, when the blob already had that state (or has no row).
    """
    blob = session.get(Blob, digest, with_for_update=True, populate_existing=True)
    if blob is None or blob.health == health:
        return None
    previous, blob.health = blob.health, health
    changed = refresh_records(session, [digest])
    audit(
        session,
        actor=actor,
        jti=jti,
        action="blob.healed" if health == BLOB_OK else "blob.damaged",
        target=digest,
        outcome="ok",
        detail={"health": health, "was": previous, "records_changed": changed, **(detail or {})},
    )
    return changed


def refresh_records(session: Session, digests: list[str]) -> int:
    """Recompute the health of every record binding one of ``digests``; returns how many changed."""
    using = union(
        select(CompiledGraph.id).where(CompiledGraph.artifact_digest.in_(digests)),
        select(CompiledGraphComponent.record_id).where(CompiledGraphComponent.digest.in_(digests)),
    ).subquery()
    changed = 0
    for record_id, current in session.execute(
        select(CompiledGraph.id, CompiledGraph.health).where(CompiledGraph.id.in_(select(using)))
    ):
        health = _record_health(session, record_id)
        if health != current:
            session.execute(update(CompiledGraph).where(CompiledGraph.id == record_id).values(health=health))
            changed += 1
    return changed


def _record_health(session: Session, record_id: int) -> str:
    artifact = (
        select(Blob.health)
        .join(CompiledGraph, CompiledGraph.artifact_digest == Blob.digest)
        .where(CompiledGraph.id == record_id)
    )
    components = (
        select(Blob.health)
        .join(CompiledGraphComponent, CompiledGraphComponent.digest == Blob.digest)
        .where(CompiledGraphComponent.record_id == record_id)
    )
    states = set(session.scalars(union(artifact, components)))
    return next((_RECORD_STATE[state] for state in _RECORD_STATE if state in states), HEALTH_OK)
