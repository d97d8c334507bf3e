"""Foundation: principals, tokens, repos, blobs and their links, upload sessions, audit log.

Revision ID: 0001_foundation
Revises:
Create Date: 2026-12-02

Reviewed by hand against the models in store/cgstore/*/models.py. Runs on
PostgreSQL and SQLite (portable types only; the audit id is INTEGER on SQLite
so it autoincrements).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

revision = "0001_foundation"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "principals",
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("platform", sa.Boolean(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_principals"),
    )
    op.create_table(
        "tokens",
        sa.Column("jti", sa.String(64), nullable=False),
        sa.Column("sub", sa.String(200), nullable=False),
        sa.Column("parent_jti", sa.String(64), nullable=True),
        sa.Column("platform", sa.Boolean(), nullable=False),
        sa.Column("grants", sa.JSON(), nullable=False),
        sa.Column("issued_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("jti", name="pk_tokens"),
        sa.ForeignKeyConstraint(["parent_jti"], ["tokens.jti"], name="fk_tokens_parent_jti_tokens"),
    )
    op.create_index("ix_tokens_sub", "tokens", ["sub"])
    op.create_index("ix_tokens_parent_jti", "tokens", ["parent_jti"])

    op.create_table(
        "repos",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("owner", sa.String(40), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("visibility", sa.String(16), nullable=False),
        sa.Column("created_by", sa.String(200), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_repos"),
        sa.UniqueConstraint("owner", "name", name="uq_repos_owner_name"),
    )

    op.create_table(
        "blobs",
        sa.Column("digest", sa.String(71), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("digest", name="pk_blobs"),
    )
    op.create_table(
        "repo_blobs",
        sa.Column("repo_id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(71), nullable=False),
        sa.Column("linked_by", sa.String(200), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("repo_id", "digest", name="pk_repo_blobs"),
        sa.ForeignKeyConstraint(["repo_id"], ["repos.id"], name="fk_repo_blobs_repo_id_repos", ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["digest"], ["blobs.digest"], name="fk_repo_blobs_digest_blobs"),
    )
    op.create_index("ix_repo_blobs_digest", "repo_blobs", ["digest"])

    op.create_table(
        "upload_sessions",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("repo_id", sa.Integer(), nullable=False),
        sa.Column("principal", sa.String(200), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("storage_state", sa.JSON(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_upload_sessions"),
        sa.ForeignKeyConstraint(
            ["repo_id"], ["repos.id"], name="fk_upload_sessions_repo_id_repos", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_upload_sessions_expires_at", "upload_sessions", ["expires_at"])

    op.create_table(
        "audit_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("jti", sa.String(64), nullable=True),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(300), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_audit_events"),
    )
    op.create_index("ix_audit_events_at", "audit_events", ["at"])
    op.create_index("ix_audit_events_actor", "audit_events", ["actor"])


def downgrade() -> None:
    for index, table in [
        ("ix_audit_events_actor", "audit_events"),
        ("ix_audit_events_at", "audit_events"),
        ("ix_upload_sessions_expires_at", "upload_sessions"),
        ("ix_repo_blobs_digest", "repo_blobs"),
        ("ix_tokens_parent_jti", "tokens"),
        ("ix_tokens_sub", "tokens"),
    ]:
        op.drop_index(index, table_name=table)
    for table in ["audit_events", "upload_sessions", "repo_blobs", "blobs", "repos", "tokens", "principals"]:
        op.drop_table(table)
