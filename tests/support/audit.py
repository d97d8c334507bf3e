"""Finding audit rows in tests, 401 aggregates included.

401s are counted in memory and written as one row per (source, outcome) per
interval (``audit.denials``), so a test first flushes what the store counted,
and matches a path against an aggregate's sample ``detail.paths`` as well as
its ``target``. A test that asserts a particular 401 was audited flushes once
before sending it too (``flush_denials``), so that its path opens a fresh
aggregate rather than joining one whose samples are full.
"""

from __future__ import annotations

from sqlalchemy import select

from cgstore.audit.models import AuditEvent


def flush_denials(store) -> None:
    store.context.denials.flush()


def audited(store, outcome: str, *, target: str | None = None, jti: str | None = None) -> list[AuditEvent]:
    """Rows with ``outcome`` whose target (or sample paths) contain ``target`` and/or whose jti is ``jti``."""
    flush_denials(store)
    with store.context.db.session() as session:
        rows = session.scalars(select(AuditEvent).where(AuditEvent.outcome == outcome)).all()
    return [
        row
        for row in rows
        if (target is None or target in row.target or any(target in p for p in row.detail.get("paths", [])))
        and (jti is None or row.jti == jti)
    ]
