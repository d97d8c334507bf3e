"""Trust: owners, the signing-key ring, and a digest of each token's claims.

Revision ID: 0002_trust
Revises: 0001_foundation
Create Date: 2026-12-03

- ``owners``: slugs claimed by principals (``POST /v1/owners``).
- ``signing_keys``: the public halves of the key ring (rotation without restart).
- ``tokens.claims_digest`` / ``tokens.kid``: verification compares the presented
  claims with the record. Rows minted before this revision have no digest and
  are refused by verification: re-mint those tokens.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

revision = "0002_trust"
down_revision = "0001_foundation"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "owners",
        sa.Column("slug", sa.String(40), nullable=False),
        sa.Column("principal", sa.String(200), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("slug", name="pk_owners"),
        sa.ForeignKeyConstraint(["principal"], ["principals.name"], name="fk_owners_principal_principals"),
    )
    op.create_index("ix_owners_principal", "owners", ["principal"])
    op.create_table(
        "signing_keys",
        sa.Column("kid", sa.String(16), nullable=False),
        sa.Column("public_key", sa.Text(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("retired_at", UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("kid", name="pk_signing_keys"),
    )
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("claims_digest", sa.String(64), nullable=True))
        batch.add_column(sa.Column("kid", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("kid")
        batch.drop_column("claims_digest")
    op.drop_table("signing_keys")
    op.drop_index("ix_owners_principal", table_name="owners")
    op.drop_table("owners")
