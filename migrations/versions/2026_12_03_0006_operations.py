"""Operations: leases for background tasks; the blob columns garbage collection works with.

Revision ID: 0006_operations
Revises: 0005_records
Create Date: 2026-12-03

``leases`` lets one replica at a time run each background task (reaper, GC).
``blobs.linked_at`` (last link, initialised from ``created_at``) and
``blobs.collecting_since`` (condemned by GC) close the race between a publish
and a collection in the database; ``compiled_graphs.artifact_digest`` gets the
index GC's "does a record name this blob" needs. Runs on PostgreSQL and SQLite (batch mode
copies the table there).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

revision = "0006_operations"
down_revision = "0005_records"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.Column("acquired_at", UTCDateTime(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("cursor", sa.String(200), nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_leases"),
    )
    with op.batch_alter_table("blobs") as batch:
        batch.add_column(sa.Column("linked_at", UTCDateTime(), nullable=True))
        batch.add_column(sa.Column("collecting_since", UTCDateTime(), nullable=True))
    op.execute("UPDATE blobs SET linked_at = created_at")
    with op.batch_alter_table("blobs") as batch:
        batch.alter_column("linked_at", existing_type=UTCDateTime(), nullable=False)
    # GC asks, per blob, whether any record names it as its artifact.
    op.create_index("ix_compiled_graphs_artifact_digest", "compiled_graphs", ["artifact_digest"])


def downgrade() -> None:
    op.drop_index("ix_compiled_graphs_artifact_digest", table_name="compiled_graphs")
    with op.batch_alter_table("blobs") as batch:
        batch.drop_column("collecting_since")
        batch.drop_column("linked_at")
    op.drop_table("leases")
