"""The record events feed: one append-only row per publish and per yank, in commit order.

Revision ID: 0019_record_events
Revises: 0017_search_visible_rows
Create Date: 2026-12-06

Issue 26 §2: running workers learn that a record was published or yanked from
``GET /v1/compiled-graphs:events`` instead of restarting. The feed is a table
written in the transaction of the publish or the yank itself
(``compiled_graphs/events.py``), so a committed record and its event are one
fact and no event tells of a publish that rolled back. Its ids are gapless and
in commit order (each event takes the head plus one under a lock held until
commit), which is what lets a reader's position be a plain id.

A new, empty table: creating it and its three indexes locks nothing existing
and costs nothing on a large registry. Old events are trimmed by the GC task
after ``CGSTORE_EVENTS_RETENTION_S``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

revision = "0019_record_events"
down_revision = "0018_claims"
branch_labels = None
depends_on = None

_TABLE = "record_events"


def upgrade() -> None:
    op.create_table(
        _TABLE,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=False, nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("repo_id", sa.Integer(), nullable=False),
        sa.Column("publisher", sa.String(200), nullable=False),
        sa.Column("family", sa.String(100), nullable=False),
        sa.Column("key", sa.String(96), nullable=False),
        sa.Column("discovery_digest", sa.String(71), nullable=True),
        sa.Column("binding_signature", sa.String(71), nullable=True),
        sa.Column("release", sa.String(128), nullable=True),
        sa.Column("reason", sa.String(1000), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_record_events"),
        sa.ForeignKeyConstraint(["repo_id"], ["repos.id"], name="fk_record_events_repo_id_repos", ondelete="CASCADE"),
    )
    op.create_index("ix_record_events_repo", _TABLE, ["repo_id", "id"])
    op.create_index("ix_record_events_reader", _TABLE, ["repo_id", "publisher", "id"])
    op.create_index("ix_record_events_at", _TABLE, ["at"])


def downgrade() -> None:
    for index in ("ix_record_events_at", "ix_record_events_reader", "ix_record_events_repo"):
        op.drop_index(index, table_name=_TABLE)
    op.drop_table(_TABLE)
