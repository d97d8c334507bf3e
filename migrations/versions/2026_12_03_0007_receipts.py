"""Signed publish receipts: the receipt a publish answered, kept on the record it vouches for.

Revision ID: 0007_receipts
Revises: 0005_records
Create Date: 2026-12-03

Reviewed by hand against store/cgstore/compiled_graphs/models.py. Nullable:
records published before this revision carry no receipt until re-published
(a 200 re-publish signs one and keeps it).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_receipts"
down_revision = "0005_records"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "compiled_graphs",
        sa.Column("receipt", sa.Text(), nullable=True),
    )


def downgrade() -> None:
    op.drop_column("compiled_graphs", "receipt")
