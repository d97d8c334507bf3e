"""Mint claims: one row per claimed declaration (issue 26 §1).

Revision ID: 0018_claims
Revises: 0017_search_visible_rows
Create Date: 2026-12-06

A fleet that misses on a new declaration must compile it once, not once per
worker: ``POST …/compiled-graphs:claim`` grants one claimer per declaration
and the others wait. The ``declaration_claims`` table holds, per
(repo, discovery digest, binding signature, release, scope), the claim live now
(if any) and how the declaration's mints went (failures in a row, backoff,
``failing``). Its unique constraint is what makes "one live claim per
declaration" hold across replicas on both databases; the partial unique index
on ``claim`` finds a claim by id for its heartbeat and release; the partial
index on ``failing_since`` lists failing declarations for the console.

Cost: a new, empty table and its indexes; no existing table is read or locked
(the foreign key to ``repos`` takes a brief SHARE ROW EXCLUSIVE lock on
``repos`` on PostgreSQL while it is added).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

revision = "0018_claims"
down_revision = "0017_search_visible_rows"
branch_labels = None
depends_on = None

_TABLE = "declaration_claims"
_IN_FLIGHT = sa.text("claim IS NOT NULL")
_FAILING = sa.text("failing_since IS NOT NULL")


def upgrade() -> None:
    op.create_table(
        _TABLE,
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("repo_id", sa.Integer(), nullable=False),
        sa.Column("discovery_digest", sa.String(71), nullable=False),
        sa.Column("binding_signature", sa.String(100), nullable=False),
        sa.Column("release", sa.String(128), nullable=False),
        sa.Column("scope", sa.String(200), nullable=False),
        sa.Column("family", sa.String(100), nullable=False),
        sa.Column("sm", sa.String(128), nullable=False),
        sa.Column("claim", sa.String(64), nullable=True),
        sa.Column("holder", sa.String(200), nullable=True),
        sa.Column("granted_at", UTCDateTime(), nullable=True),
        sa.Column("expires_at", UTCDateTime(), nullable=True),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(1000), nullable=True),
        sa.Column("retry_at", UTCDateTime(), nullable=True),
        sa.Column("failing_since", UTCDateTime(), nullable=True),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_declaration_claims"),
        sa.ForeignKeyConstraint(
            ["repo_id"], ["repos.id"], name="fk_declaration_claims_repo_id_repos", ondelete="CASCADE"
        ),
        sa.UniqueConstraint(
            "repo_id", "discovery_digest", "binding_signature", "release", "scope", name="uq_declaration_claims_identity"
        ),
    )
    op.create_index(
        "uq_declaration_claims_claim",
        _TABLE,
        ["claim"],
        unique=True,
        sqlite_where=_IN_FLIGHT,
        postgresql_where=_IN_FLIGHT,
    )
    op.create_index(
        "ix_declaration_claims_failing", _TABLE, ["failing_since"], sqlite_where=_FAILING, postgresql_where=_FAILING
    )


def downgrade() -> None:
    op.drop_index("ix_declaration_claims_failing", table_name=_TABLE)
    op.drop_index("uq_declaration_claims_claim", table_name=_TABLE)
    op.drop_table(_TABLE)
