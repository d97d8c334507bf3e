"""The audit log table: append-only; no code path updates or deletes a row.

On both dialects the migration (``0003_audit``) also installs triggers that
refuse UPDATE and DELETE on ``audit_events`` (and TRUNCATE on PostgreSQL), so
a bug or a stray SQL session cannot rewrite history either.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, BigInteger, Integer, String, text
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime, utcnow

# Column bounds: every string is escaped and cut to these by ``audit.service.clean``.
ACTOR_LEN = 200
JTI_LEN = 64
ACTION_LEN = 128
TARGET_LEN = 512
REPO_LEN = 141  # owner (40) + "/" + repo (100)
OUTCOME_LEN = 32
SOURCE_LEN = 64


class AuditEvent(Base):
    """One mutation or one denial, or one aggregate of repeated unauthenticated denials.

    (The id is INTEGER on SQLite, where only INTEGER PRIMARY KEY autoincrements.)

    Columns:
      id       monotonically increasing; the keyset cursor of the audit listing.
      at       when it happened (for an aggregate: the first denial of its interval).
      actor    the token's ``sub``, or ``-`` when no valid token was presented.
      jti      the token's id, if any (never the token itself).
      action   what was attempted, e.g. ``blob.upload``, ``token.mint``, ``GET /v1/…``.
      target   what it was attempted on, e.g. ``acme/models@blake3:…`` or a request path.
      repo     ``owner/repo`` the entry concerns, when it concerns one (filterable).
      outcome  ``ok``, or the protocol error code of the refusal.
      source   the client's address, for denials (``None`` for entries written by the CLI).
      count    how many events the row stands for: 1, or the number of 401s
               from ``source`` with ``outcome`` aggregated into this row.
      detail   extra facts (JSON; strings escaped and bounded like the columns).
    """

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False, index=True)
    actor: Mapped[str] = mapped_column(String(ACTOR_LEN), nullable=False, index=True)
    jti: Mapped[str | None] = mapped_column(String(JTI_LEN), nullable=True, index=True)
    action: Mapped[str] = mapped_column(String(ACTION_LEN), nullable=False, index=True)
    target: Mapped[str] = mapped_column(String(TARGET_LEN), nullable=False, index=True)
    repo: Mapped[str | None] = mapped_column(String(REPO_LEN), nullable=True, index=True)
    outcome: Mapped[str] = mapped_column(String(OUTCOME_LEN), nullable=False, index=True)
    source: Mapped[str | None] = mapped_column(String(SOURCE_LEN), nullable=True, index=True)
    count: Mapped[int] = mapped_column(Integer, nullable=False, default=1, server_default=text("1"))
    detail: Mapped[dict] = mapped_column(JSON, nullable=False, default=dict)
