"""The claims table: one row per claimed declaration, holding its current claim and its failure history.

A row is a declaration's *slot*: its identity is (repo, discovery digest,
binding signature, release, scope), unique in the database, so two replicas
racing to create it end with one row (``INSERT … ON CONFLICT DO NOTHING``), and
a claimer locks that row (``SELECT … FOR UPDATE`` on PostgreSQL; SQLite's one
writer at a time) before deciding. A slot has at most one ``claim`` at a time:
"at most one live claim per identity" is the row's uniqueness, not a check in
Python that two replicas could both pass.

Absent parts of the identity are stored as ``""`` (never NULL): a unique
constraint treats NULLs as distinct, and a declaration without a release must
collide with itself. The scope is ``""`` except in a private cache (visibility
``principal``), where it is the claimer: another tenant's claim there is
another slot, invisible and never blocking (``access`` "Private tenant caches").

The row stays after a claim ends, so the next claim knows how many mints of
the declaration failed or expired in a row (backoff, ``failing``).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import ForeignKey, Index, Integer, String, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime, utcnow

_IN_FLIGHT = text("claim IS NOT NULL")
_FAILING = text("failing_since IS NOT NULL")


class DeclarationClaim(Base):
    """A claimed declaration: who holds its mint now (if anyone), and how its mints have gone.

    Columns:
      id                 surrogate key: how the console and ``cgstore claims`` name a slot.
      repo_id            the repo the mint will publish to.
      discovery_digest   the declaration's discovery digest (``admission.discovery_of``, as discover computes it).
      binding_signature  the declared ``bs1:…``; ``""`` when the declaration named none.
      release            the declared release; ``""`` when none.
      scope              ``""``, or in a private cache the claiming principal.
      family             the declared family (shown; the digest already covers it).
      sm                 the declared sm (shown).
      claim              the live claim's opaque id; NULL when nobody holds the mint.
      holder             the principal holding ``claim`` (only it may beat or release it).
      granted_at         when ``claim`` was granted.
      expires_at         when ``claim`` lapses unless beaten (TTL ``CGSTORE_CLAIM_TTL_S``).
      failures           mints of this declaration that failed or expired in a row (0 after a publish).
      reason             the last failure's reason (``expired`` for a lapsed claim).
      retry_at           after a failed release: no grant before this time (backoff).
      failing_since      set when ``failures`` reached the limit: no grant until cleared.
      updated_at         the last change.
    """

    __tablename__ = "declaration_claims"
    __table_args__ = (
        UniqueConstraint(
            "repo_id",
            "discovery_digest",
            "binding_signature",
            "release",
            "scope",
            name="uq_declaration_claims_identity",
        ),
        Index(
            "uq_declaration_claims_claim", "claim", unique=True, sqlite_where=_IN_FLIGHT, postgresql_where=_IN_FLIGHT
        ),
        Index("ix_declaration_claims_failing", "failing_since", sqlite_where=_FAILING, postgresql_where=_FAILING),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    repo_id: Mapped[int] = mapped_column(Integer, ForeignKey("repos.id", ondelete="CASCADE"), nullable=False)
    discovery_digest: Mapped[str] = mapped_column(String(71), nullable=False)
    binding_signature: Mapped[str] = mapped_column(String(100), nullable=False)
    release: Mapped[str] = mapped_column(String(128), nullable=False)
    scope: Mapped[str] = mapped_column(String(200), nullable=False)
    family: Mapped[str] = mapped_column(String(100), nullable=False)
    sm: Mapped[str] = mapped_column(String(128), nullable=False)
    claim: Mapped[str | None] = mapped_column(String(64), nullable=True)
    holder: Mapped[str | None] = mapped_column(String(200), nullable=True)
    granted_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    failures: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    reason: Mapped[str | None] = mapped_column(String(1000), nullable=True)
    retry_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    failing_since: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
