"""Mirror eviction: when each blob was last served, so a mirror's GC can evict what its workers no longer use.

Revision ID: 0021_mirror_eviction
Revises: 0020_mirror
Create Date: 2026-12-07

Issue 27 §1: a regional mirror is a cache. Its GC evicts mirrored records
whose blobs no worker has downloaded for ``CGSTORE_MIRROR_EVICT_AFTER``
(``mirror/eviction.py``); they are pulled again from the upstream on demand.
``blobs.last_served_at`` is written by a blob download on a mirror, at most
once a minute per blob (a conditional UPDATE, so a hot blob costs no write per
read); NULL means never served since it was stored, and eviction then counts
from ``blobs.created_at``.

One nullable column without a default: PostgreSQL adds it without rewriting
the table or holding its lock for longer than the catalog change, and SQLite's
ADD COLUMN is the same metadata-only change.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

revision = "0021_mirror_eviction"
down_revision = "0020_mirror"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("blobs") as batch:
        batch.add_column(sa.Column("last_served_at", UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("blobs") as batch:
        batch.drop_column("last_served_at")
