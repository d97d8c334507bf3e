"""The audit log table: append-only; no code path updates or deletes a row.

On both dialects the migration (``0003_audit``) also installs triggers that
refuse UPDATE and DELETE on ``audit_events`` (and TRUNCATE on PostgreSQL), so
a bug or a stray SQL session cannot rewrite history either. Whoever can
disable those triggers still leaves evidence: every row carries a digest
chained to the previous row's (``audit.chain``), ``audit_head`` serializes the
appends, and ``audit_checkpoints`` holds signed statements of the chain head.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, BigInteger, Index, Integer, String, Text, text
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
DIGEST_LEN = 64  # a blake3 digest in hex


class AuditEvent(Base):
    """One mutation or one denial, or one aggregate of repeated unauthenticated denials.

    (The id is INTEGER on SQLite, where only INTEGER PRIMARY KEY autoincrements.)

    Columns:
      id       monotonically increasing, in commit order (``audit_head`` hands it out); the
               keyset cursor of the audit listing.
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
      prev     the previous entry's ``digest`` (``chain.GENESIS`` for the first chained entry).
      digest   blake3 over this entry's canonical content and ``prev`` (``chain.entry_digest``).
               ``None`` only for entries written before the chain existed (migration 0011).
    """

    __tablename__ = "audit_events"
    # Led by action: (action, at) serves an action since a moment (the overview's windows);
    # (action, id) a page of one action by id, and the skip scan that lists a prefix's actions.
    __table_args__ = (
        Index("ix_audit_events_action_at", "action", "at"),
        Index("ix_audit_events_action_id", "action", "id"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True
    )
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False, index=True)
    actor: Mapped[str] = mapped_column(String(ACTOR_LEN), nullable=False, index=True)
    jti: Mapped[str | None] = mapped_column(String(JTI_LEN), nullable=True, index=True)
    # Compared by code point on both dialects (SQLite's BINARY; "C" on PostgreSQL, whose default
    # collation may order punctuation otherwise), so the actions sharing a prefix are contiguous.
    action: Mapped[str] = mapped_column(
        String(ACTION_LEN).with_variant(String(ACTION_LEN, collation="C"), "postgresql"), nullable=False
    )
    target: Mapped[str] = mapped_column(String(TARGET_LEN), nullable=False, index=True)
    repo: Mapped[str | None] = mapped_column(String(REPO_LEN), nullable=True, index=True)
    outcome: Mapped[str] = mapped_column(String(OUTCOME_LEN), nullable=False, index=True)
    source: Mapped[str | None] = mapped_column(String(SOURCE_LEN), nullable=True, index=True)
    count: Mapped[int] = mapped_column(Integer, nullable=False, default=1, server_default=text("1"))
    detail: Mapped[dict] = mapped_column(JSON, nullable=False, default=dict)
    prev: Mapped[str | None] = mapped_column(String(DIGEST_LEN), nullable=True)
    digest: Mapped[str | None] = mapped_column(String(DIGEST_LEN), nullable=True, unique=True, index=True)


class AuditHead(Base):
    """The one row (``id`` 1) naming the chain's last entry: the lock every append takes.

    Appends update it first, so on PostgreSQL they queue on its row lock (and
    on SQLite on the database's write lock): the next id and the previous
    digest are read by one writer at a time, and id order is chain order.
    ``start_id`` is the chain's first entry (migration 0016; 1 for a log chained
    from its first entry): it never changes, and every checkpoint signs it.
    """

    __tablename__ = "audit_head"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    last_id: Mapped[int] = mapped_column(BigInteger, nullable=False)
    digest: Mapped[str] = mapped_column(String(DIGEST_LEN), nullable=False)
    start_id: Mapped[int] = mapped_column(BigInteger, nullable=False, default=1, server_default=text("1"))


class AuditCheckpoint(Base):
    """A signed statement "entry ``audit_id`` had digest ``digest`` at ``at``", by the key ``kid``.

    ``statement`` is a compact JWS (EdDSA, the key ring that signs tokens and
    receipts, so ``GET /v1/keys`` verifies it) whose claims repeat the columns.
    ``start_id`` is the chain's first entry as signed (claim ``start``); ``None``
    for checkpoints signed before migration 0016, which did not sign it.
    """

    __tablename__ = "audit_checkpoints"

    audit_id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True)
    digest: Mapped[str] = mapped_column(String(DIGEST_LEN), nullable=False)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    kid: Mapped[str] = mapped_column(String(16), nullable=False)
    statement: Mapped[str] = mapped_column(Text, nullable=False)
    start_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
