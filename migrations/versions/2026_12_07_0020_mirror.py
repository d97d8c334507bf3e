"""Regional mirrors: where a record was admitted, and the mirror's own small state.

Revision ID: 0020_mirror
Revises: 0019_record_events
Create Date: 2026-12-07

Issue 27 §1: a store started with ``CGSTORE_UPSTREAM_URL`` pulls records from
its upstream and keeps them with the upstream's receipt unchanged.
``compiled_graphs.origin`` says which store admitted a row (NULL: this one; a
mirrored row: the upstream's URL), so a mirror tells what it admitted itself
from what it only caches. ``mirror_state`` holds a few named JSON values every
replica of the mirror shares: the upstream keys it trusts and their
fingerprint, the upstream feed's cursor, the last contact.

A nullable column without a default (no table rewrite on PostgreSQL, no
backfill) and a new, empty table: cheap on a large registry.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

revision = "0020_mirror"
down_revision = "0019_record_events"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("compiled_graphs") as batch:
        batch.add_column(sa.Column("origin", sa.String(300), nullable=True))
    op.create_table(
        "mirror_state",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("value", sa.JSON(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_mirror_state"),
    )


def downgrade() -> None:
    op.drop_table("mirror_state")
    with op.batch_alter_table("compiled_graphs") as batch:
        batch.drop_column("origin")
