"""Signed publish receipts: the receipt a publish answered, kept on the record it vouches for.

Revision ID: 0007_receipts
Revises: 0006_operations
Create Date: 2026-12-03

Reviewed by hand against store/cgstore/compiled_graphs/models.py. The
receipt and the kid that signed it (``cgstore keys retire`` re-signs a retired
key's receipts). Nullable:
records published before this revision carry no receipt until re-published
(a 200 re-publish signs one and keeps it).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_receipts"
down_revision = "0006_operations"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("compiled_graphs", sa.Column("receipt", sa.Text(), nullable=True))
    op.add_column("compiled_graphs", sa.Column("receipt_kid", sa.String(16), nullable=True))
    # Retiring a key finds the receipts it signed by this index (to re-sign them).
    op.create_index("ix_compiled_graphs_receipt_kid", "compiled_graphs", ["receipt_kid"])


def downgrade() -> None:
    op.drop_index("ix_compiled_graphs_receipt_kid", table_name="compiled_graphs")
    op.drop_column("compiled_graphs", "receipt_kid")
    op.drop_column("compiled_graphs", "receipt")
