"""The audit chain records where it starts, and every checkpoint signs that.

Revision ID: 0016_audit_chain_start
Revises: 0015_audit_action_pages
Create Date: 2026-12-06

``cgstore audit verify`` counted an entry without a digest as "from before the
chain" wherever it stood, so clearing the digests of a prefix of the log (and
starting a new genesis after it) passed as history older than the chain. Now
the chain's first entry is a fact the checkpoints sign:

- ``audit_head.start_id``: the id of the chain's first entry. For a log chained
  since revision 0011 that is its smallest id with a digest; a log with no
  chained entry yet starts at the next id the head hands out.
- ``audit_checkpoints.start_id``: the start a checkpoint signed (its ``start``
  claim); NULL for checkpoints signed before this revision.

Both are plain ADD COLUMN on both dialects, so the append-only triggers stay
(rows of ``audit_checkpoints`` are not rewritten: the new column is NULL).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016_audit_chain_start"
down_revision = "0015_audit_action_pages"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("audit_head", sa.Column("start_id", sa.BigInteger(), nullable=False, server_default=sa.text("1")))
    op.execute(
        "UPDATE audit_head SET start_id = COALESCE("
        "(SELECT MIN(id) FROM audit_events WHERE digest IS NOT NULL), last_id + 1)"
    )
    op.add_column("audit_checkpoints", sa.Column("start_id", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # DROP COLUMN: SQLite >= 3.35 drops in place (the append-only triggers stay).
    op.drop_column("audit_checkpoints", "start_id")
    op.drop_column("audit_head", "start_id")
