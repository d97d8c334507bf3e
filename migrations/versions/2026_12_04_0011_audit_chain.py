"""Audit tamper evidence: a digest chain over ``audit_events``, its head, and signed checkpoints.

Revision ID: 0011_audit_chain
Revises: 0009_scrub
Create Date: 2026-12-04

Adds ``audit_events.prev`` and ``audit_events.digest`` (unique: ``verify``
finds a moved entry by its digest), ``audit_head`` (one row, the lock every
append takes: ``last_id`` and the ``digest`` the next entry chains to) and
``audit_checkpoints`` (the signed statements of the head).

Existing entries are not chained: rewriting them would mean lifting the
append-only triggers, and a digest computed now would vouch for history it
never saw. They keep ``digest`` NULL; the chain starts at the first entry
written after this migration, whose ``prev`` is the genesis value (64 zeros),
and ``audit_head`` starts at the current largest id, so ids go on from there.
(``cgstore audit verify`` counts the older entries as unchained.)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

revision = "0011_audit_chain"
down_revision = "0009_scrub"
branch_labels = None
depends_on = None

GENESIS = "0" * 64


def upgrade() -> None:
    # Plain ADD COLUMN on both dialects (nullable, no default): SQLite keeps the table and its triggers.
    op.add_column("audit_events", sa.Column("prev", sa.String(64), nullable=True))
    op.add_column("audit_events", sa.Column("digest", sa.String(64), nullable=True))
    op.create_index("ix_audit_events_digest", "audit_events", ["digest"], unique=True)
    op.create_table(
        "audit_head",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("last_id", sa.BigInteger(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_audit_head"),
    )
    op.execute(
        sa.text("INSERT INTO audit_head (id, last_id, digest) SELECT 1, COALESCE(MAX(id), 0), :genesis FROM audit_events")
        .bindparams(genesis=GENESIS)
    )
    op.create_table(
        "audit_checkpoints",
        sa.Column("audit_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("kid", sa.String(16), nullable=False),
        sa.Column("statement", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("audit_id", name="pk_audit_checkpoints"),
    )


def downgrade() -> None:
    op.drop_table("audit_checkpoints")
    op.drop_table("audit_head")
    op.drop_index("ix_audit_events_digest", table_name="audit_events")
    # DROP COLUMN: SQLite >= 3.35 drops in place (the append-only triggers stay).
    op.drop_column("audit_events", "digest")
    op.drop_column("audit_events", "prev")
