"""Scrub: each blob's health, and where an interrupted scrub resumes.

Revision ID: 0009_scrub
Revises: 0008_private_caches
Create Date: 2026-12-03

``blobs.health`` is what the last scrub (or verified re-upload) found: ``ok``,
``missing`` or ``corrupt``; existing rows start ``ok`` (nothing has said
otherwise). ``scrub_cursors`` keeps, per scope (``*`` or ``owner/repo``), the
last digest a scrub finished, so ``cgstore scrub --resume`` continues there.
``ix_compiled_graphs_unhealthy`` (partial) lists the records the scrub took
out of resolve without scanning the table.
Runs on PostgreSQL and SQLite (batch mode copies the table there).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

revision = "0009_scrub"
down_revision = "0008_private_caches"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("blobs") as batch:
        batch.add_column(sa.Column("health", sa.String(16), nullable=False, server_default="ok"))
    op.create_table(
        "scrub_cursors",
        sa.Column("scope", sa.String(300), nullable=False),
        sa.Column("cursor", sa.String(71), nullable=True),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("scope", name="pk_scrub_cursors"),
    )
    unhealthy = sa.text("yanked_at IS NULL AND health <> 'ok'")
    op.create_index("ix_compiled_graphs_unhealthy", "compiled_graphs", ["id"],
                    sqlite_where=unhealthy, postgresql_where=unhealthy)


def downgrade() -> None:
    op.drop_index("ix_compiled_graphs_unhealthy", table_name="compiled_graphs")
    op.drop_table("scrub_cursors")
    with op.batch_alter_table("blobs") as batch:
        batch.drop_column("health")
