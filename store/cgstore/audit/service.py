"""Appending to the audit log. Every mutation and every denial goes through ``record``."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session

from cgstore.audit.models import AuditEvent

log = logging.getLogger(__name__)


def record(
    session: Session,
    *,
    actor: str,
    jti: str | None,
    action: str,
    target: str,
    outcome: str = "ok",
    detail: dict[str, Any] | None = None,
) -> None:
    """Add one entry to the caller's unit of work (committed with it)."""
    session.add(
        AuditEvent(actor=actor[:200], jti=jti, action=action, target=target[:300], outcome=outcome, detail=detail or {})
    )


def record_denial(db, **fields: Any) -> None:
    """Record a refusal in its own transaction: the refused request's work is rolled back.

    A denial that cannot be audited (database down) is logged instead; the
    refusal itself still stands.
    """
    try:
        with db.session() as session:
            record(session, **fields)
    except Exception:  # the caller is already answering with an error; don't mask it
        log.exception("could not audit denial %s", fields)
