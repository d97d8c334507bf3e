"""Private tenant caches: every principal that linked a blob into a repo, not only the first.

Revision ID: 0008_private_caches
Revises: 0007_receipts
Create Date: 2026-12-03

Reviewed by hand against store/cgstore/blobs/models.py. In a ``principal``
repo a blob is readable by the principals that uploaded (or mounted) it there:
two tenants minting the same bytes each hold their own link. Existing links
are carried over from ``repo_blobs.linked_by``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

revision = "0008_private_caches"
down_revision = "0007_receipts"
branch_labels = None
depends_on = None


def upgrade() -> None:
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
