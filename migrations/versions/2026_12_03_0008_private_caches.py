"""Private tenant caches: each principal's own blob links, and write-once per publisher.

Revision ID: 0008_private_caches
Revises: 0007_receipts
Create Date: 2026-12-03

Reviewed by hand against store/cgstore/blobs/models.py. In a ``principal``
repo a blob is readable by the principals that uploaded (or mounted) it there:
two tenants minting the same bytes each hold their own link. Existing links
are carried over from ``repo_blobs.linked_by``. Records get a write-once
``scope`` ('' for the repo, the publisher in a private cache) and the live-key
unique index covers it; existing records keep the repo scope.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

_LIVE = sa.text("yanked_at IS NULL")
_PARTIAL = {"sqlite_where": _LIVE, "postgresql_where": _LIVE}

revision = "0008_private_caches"
down_revision = "0007_receipts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("compiled_graphs", sa.Column("scope", sa.String(200), nullable=False, server_default=""))
    op.drop_index("uq_compiled_graphs_live_key", table_name="compiled_graphs")
    op.create_index("uq_compiled_graphs_live_key", "compiled_graphs", ["repo_id", "key", "scope"], unique=True,
                    **_PARTIAL)
    op.create_table(
        "repo_blob_holders",
        sa.Column("repo_id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(71), nullable=False),
        sa.Column("principal", sa.String(200), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("repo_id", "digest", "principal", name="pk_repo_blob_holders"),
        sa.ForeignKeyConstraint(
            ["repo_id", "digest"], ["repo_blobs.repo_id", "repo_blobs.digest"],
            name="fk_repo_blob_holders_repo_id_repo_blobs", ondelete="CASCADE",
        ),
    )
    op.execute(
        "INSERT INTO repo_blob_holders (repo_id, digest, principal, created_at) "
        "SELECT repo_id, digest, linked_by, created_at FROM repo_blobs"
    )


def downgrade() -> None:
    op.drop_table("repo_blob_holders")
    # Refused by the database if a private cache holds two tenants' records of one key: nothing is lost silently.
    op.drop_index("uq_compiled_graphs_live_key", table_name="compiled_graphs")
    op.create_index("uq_compiled_graphs_live_key", "compiled_graphs", ["repo_id", "key"], unique=True, **_PARTIAL)
    op.drop_column("compiled_graphs", "scope")
