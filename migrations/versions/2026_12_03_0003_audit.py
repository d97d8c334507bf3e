"""Audit, complete: filterable columns, aggregate counts, indexes, and append-only triggers.

Revision ID: 0003_audit
Revises: 0002_trust
Create Date: 2026-12-03

Adds to ``audit_events``: ``repo`` (``owner/repo`` an entry concerns),
``source`` (client address of a denial), ``count`` (how many 401s an aggregate
row stands for; 1 otherwise); widens ``action`` to 128 and ``target`` to 512
characters (the bounds ``audit.service.clean`` cuts to); indexes every column
the listing filters on. Then makes the table append-only in the database
itself: triggers refuse UPDATE and DELETE on both dialects, and TRUNCATE on
PostgreSQL. (DROP TABLE, as the foundation's downgrade does, is still allowed.)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_audit"
down_revision = "0002_trust"
branch_labels = None
depends_on = None

_NEW_INDEXES = ["jti", "action", "target", "repo", "outcome", "source"]

_PG_FUNCTION = """
CREATE FUNCTION audit_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_events is append-only (% refused)', TG_OP;
END
$$
"""
_PG_TRIGGERS = [
    "CREATE TRIGGER audit_events_no_change BEFORE UPDATE OR DELETE ON audit_events "
    "FOR EACH ROW EXECUTE FUNCTION audit_events_append_only()",
    "CREATE TRIGGER audit_events_no_truncate BEFORE TRUNCATE ON audit_events "
    "FOR EACH STATEMENT EXECUTE FUNCTION audit_events_append_only()",
]
_SQLITE_TRIGGERS = [
    "CREATE TRIGGER audit_events_no_update BEFORE UPDATE ON audit_events "
    "BEGIN SELECT RAISE(ABORT, 'audit_events is append-only (UPDATE refused)'); END",
    "CREATE TRIGGER audit_events_no_delete BEFORE DELETE ON audit_events "
    "BEGIN SELECT RAISE(ABORT, 'audit_events is append-only (DELETE refused)'); END",
]


def _is_postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    with op.batch_alter_table("audit_events") as batch:
        batch.add_column(sa.Column("repo", sa.String(141), nullable=True))
        batch.add_column(sa.Column("source", sa.String(64), nullable=True))
        batch.add_column(sa.Column("count", sa.Integer(), nullable=False, server_default=sa.text("1")))
        batch.alter_column("action", existing_type=sa.String(64), type_=sa.String(128), existing_nullable=False)
        batch.alter_column("target", existing_type=sa.String(300), type_=sa.String(512), existing_nullable=False)
    for column in _NEW_INDEXES:
        op.create_index(f"ix_audit_events_{column}", "audit_events", [column])
    if _is_postgres():
        op.execute(_PG_FUNCTION)
        for statement in _PG_TRIGGERS:
            op.execute(statement)
    else:
        for statement in _SQLITE_TRIGGERS:
            op.execute(statement)


def downgrade() -> None:
    if _is_postgres():
        op.execute("DROP TRIGGER audit_events_no_truncate ON audit_events")
        op.execute("DROP TRIGGER audit_events_no_change ON audit_events")
        op.execute("DROP FUNCTION audit_events_append_only()")
    else:
        op.execute("DROP TRIGGER audit_events_no_delete")
        op.execute("DROP TRIGGER audit_events_no_update")
    for column in reversed(_NEW_INDEXES):
        op.drop_index(f"ix_audit_events_{column}", table_name="audit_events")
    # Rows written since the upgrade may be longer than the old bounds: cut them
    # on PostgreSQL (SQLite does not enforce VARCHAR lengths).
    with op.batch_alter_table("audit_events") as batch:
        batch.alter_column(
            "target", existing_type=sa.String(512), type_=sa.String(300), existing_nullable=False,
            postgresql_using="left(target, 300)",
        )
        batch.alter_column(
            "action", existing_type=sa.String(128), type_=sa.String(64), existing_nullable=False,
            postgresql_using="left(action, 64)",
        )
        batch.drop_column("count")
        batch.drop_column("source")
        batch.drop_column("repo")
