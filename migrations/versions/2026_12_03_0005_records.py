"""Compiled-graph records and their named components.

Revision ID: 0005_records
Revises: 0003_audit
Create Date: 2026-12-03

Reviewed by hand against store/cgstore/compiled_graphs/models.py. Runs on
PostgreSQL and SQLite: partial indexes (``WHERE yanked_at IS NULL``) exist on
both, and give one live record per (repo, key) while yanked rows stay.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore.core.db import UTCDateTime

revision = "0005_records"
down_revision = "0003_audit"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_LIVE = sa.text("yanked_at IS NULL")


def upgrade() -> None:
    op.create_table(
        "compiled_graphs",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("repo_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(96), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("family", sa.String(100), nullable=False),
        sa.Column("lane", sa.String(64), nullable=False),
        sa.Column("sm", sa.String(128), nullable=False),
        sa.Column("graph_digest", sa.String(71), nullable=False),
        sa.Column("envelope", sa.JSON(), nullable=False),
        sa.Column("envelope_digest", sa.String(71), nullable=False),
        sa.Column("toolchain", sa.JSON(), nullable=False),
        sa.Column("toolchain_digest", sa.String(71), nullable=False),
        sa.Column("recorded_versions", sa.JSON(), nullable=False),
        sa.Column("artifact_digest", sa.String(71), nullable=False),
        sa.Column("artifact_size", sa.BigInteger(), nullable=False),
        sa.Column("component_set", sa.String(71), nullable=False),
        sa.Column("layout_display", sa.String(200), nullable=True),
        sa.Column("layout_topology", sa.String(71), nullable=True),
        sa.Column("layout_quant", sa.String(71), nullable=True),
        sa.Column("input_contract", sa.JSON(), nullable=False),
        sa.Column("binding_table", sa.JSON(), nullable=False),
        sa.Column("kernel_lane", sa.JSON(), nullable=True),
        sa.Column("kernel_lane_evidence", sa.JSON(), nullable=True),
        sa.Column("mint_phases", sa.JSON(), nullable=True),
        sa.Column("publisher", sa.String(200), nullable=False),
        sa.Column("publisher_jti", sa.String(64), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("yanked_at", UTCDateTime(), nullable=True),
        sa.Column("yanked_by", sa.String(200), nullable=True),
        sa.Column("yank_reason", sa.String(1000), nullable=True),
        sa.Column("health", sa.String(16), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_compiled_graphs"),
        sa.ForeignKeyConstraint(
            ["repo_id"], ["repos.id"], name="fk_compiled_graphs_repo_id_repos", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["artifact_digest"], ["blobs.digest"], name="fk_compiled_graphs_artifact_digest_blobs"
        ),
    )
    partial = {"sqlite_where": _LIVE, "postgresql_where": _LIVE}
    op.create_index("uq_compiled_graphs_live_key", "compiled_graphs", ["repo_id", "key"], unique=True, **partial)
    op.create_index("ix_compiled_graphs_resolve", "compiled_graphs", ["key", "family"], **partial)
    op.create_index("ix_compiled_graphs_list", "compiled_graphs", ["repo_id", "id"], **partial)
    op.create_index("ix_compiled_graphs_list_family", "compiled_graphs", ["repo_id", "family", "id"], **partial)

    op.create_table(
        "compiled_graph_components",
        sa.Column("record_id", _ID, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("digest", sa.String(71), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("record_id", "name", name="pk_compiled_graph_components"),
        sa.ForeignKeyConstraint(
            ["record_id"], ["compiled_graphs.id"],
            name="fk_compiled_graph_components_record_id_compiled_graphs", ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["digest"], ["blobs.digest"], name="fk_compiled_graph_components_digest_blobs"
        ),
    )
    op.create_index("ix_compiled_graph_components_digest", "compiled_graph_components", ["digest"])


def downgrade() -> None:
    op.drop_index("ix_compiled_graph_components_digest", table_name="compiled_graph_components")
    op.drop_table("compiled_graph_components")
    for index in (
        "ix_compiled_graphs_list_family",
        "ix_compiled_graphs_list",
        "ix_compiled_graphs_resolve",
        "uq_compiled_graphs_live_key",
    ):
        op.drop_index(index, table_name="compiled_graphs")
    op.drop_table("compiled_graphs")
