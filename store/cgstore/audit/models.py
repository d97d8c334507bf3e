"""The audit log table: append-only; no code path updates or deletes a row."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, BigInteger, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime, utcnow


class AuditEvent(Base):
    """One mutation or one denial.

    (The id is INTEGER on SQLite, where only INTEGER PRIMARY KEY autoincrements.)

    Columns:
      id       monotonically increasing; the ``after`` cursor of the audit listing.
      at       when it happened.
      actor    the token's ``sub``, or ``-`` when no valid token was presented.
      jti      the token's id, if any.
      action   what was attempted, e.g. ``blob.upload``, ``token.mint``, ``auth``.
      target   what it was attempted on, e.g. ``acme/models`` or a digest.
      outcome  ``ok``, or the protocol error code of the refusal.
      detail   extra facts (JSON).
    """

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False, index=True)
    actor: Mapped[str] = mapped_column(String(200), nullable=False, index=True)
    jti: Mapped[str | None] = mapped_column(String(64), nullable=True)
    action: Mapped[str] = mapped_column(String(64), nullable=False)
    target: Mapped[str] = mapped_column(String(300), nullable=False)
    outcome: Mapped[str] = mapped_column(String(32), nullable=False)
    detail: Mapped[dict] = mapped_column(JSON, nullable=False, default=dict)
