"""Garbage collection's view of records: which blobs records keep, and forgetting yanked records' links."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import ColumnElement, delete, exists, or_, select
from sqlalchemy.orm import Session

from cgstore.blobs.models import Blob
from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphComponent


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
