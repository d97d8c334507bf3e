"""Discovery at boot (issue 16): what a declaration is matched on, and workers' drift reports.

Revision ID: 0012_discovery
Revises: 0011_audit_chain
Create Date: 2026-12-04

Adds to ``compiled_graphs``: ``discovery_digest`` (family, envelope, sm, keyed
toolchain and the model libraries' recorded versions, hashed by
``cgstore_client.binding.discovery_digest``), ``binding_signature`` (``bs1:``,
the tensors bound from the checkpoint), ``release`` and ``code_fingerprint``
(declared by the publisher), ``drift_reports`` (default 0), and the partial
index discover reads live rows through.

Backfill: ``discovery_digest`` is computed for every existing row from the
columns it already has (the same derivation admission uses now), so existing
records are discovered by declaration. ``binding_signature`` is left NULL:
it folds the archive's ties, which only the archive holds (the record's
binding table does not say which names are one tensor), so an existing
record is never found by a discover that names a binding signature (a
re-publish of the same bytes does not fill it either: records are
write-once). ``release`` and ``code_fingerprint`` were never declared: NULL.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from cgstore_client.binding import discovery_digest

revision = "0012_discovery"
down_revision = "0011_audit_chain"
branch_labels = None
depends_on = None

_LIVE = sa.text("yanked_at IS NULL")
#: Rows read and updated per round trip while backfilling.
_BATCH = 500


def upgrade() -> None:
    with op.batch_alter_table("compiled_graphs") as batch:
        batch.add_column(sa.Column("discovery_digest", sa.String(71), nullable=True))
        batch.add_column(sa.Column("binding_signature", sa.String(71), nullable=True))
        batch.add_column(sa.Column("release", sa.String(128), nullable=True))
        batch.add_column(sa.Column("code_fingerprint", sa.String(71), nullable=True))
        batch.add_column(sa.Column("drift_reports", sa.Integer(), nullable=False, server_default=sa.text("0")))
    op.create_index("ix_compiled_graphs_discover", "compiled_graphs",
                    ["discovery_digest", "binding_signature", "release"],
                    sqlite_where=_LIVE, postgresql_where=_LIVE)
    _backfill_discovery_digests(op.get_bind())


def _backfill_discovery_digests(conn: sa.Connection) -> None:
    table = sa.table(
        "compiled_graphs", sa.column("id", sa.Integer), sa.column("family", sa.String),
        sa.column("envelope_digest", sa.String), sa.column("sm", sa.String),
        sa.column("toolchain_digest", sa.String), sa.column("recorded_versions", sa.JSON),
        sa.column("discovery_digest", sa.String),
    )
    after = 0
    while True:
        rows = conn.execute(
            sa.select(table.c.id, table.c.family, table.c.envelope_digest, table.c.sm, table.c.toolchain_digest,
                      table.c.recorded_versions)
            .where(table.c.id > after).order_by(table.c.id).limit(_BATCH)
        ).all()
        if not rows:
            return
        conn.execute(
            table.update().where(table.c.id == sa.bindparam("row_id")).values(discovery_digest=sa.bindparam("value")),
            [{"row_id": row.id,
              "value": discovery_digest(row.family, row.envelope_digest, row.sm, row.toolchain_digest,
                                        row.recorded_versions or {})}
             for row in rows],
        )
        after = rows[-1].id


def downgrade() -> None:
    op.drop_index("ix_compiled_graphs_discover", table_name="compiled_graphs")
    with op.batch_alter_table("compiled_graphs") as batch:
        batch.drop_column("drift_reports")
        batch.drop_column("code_fingerprint")
        batch.drop_column("release")
        batch.drop_column("binding_signature")
        batch.drop_column("discovery_digest")
