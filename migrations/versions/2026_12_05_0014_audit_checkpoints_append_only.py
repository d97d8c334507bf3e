"""The audit chain's checkpoints are append-only, and its head row cannot be deleted.

Revision ID: 0014_checkpoints_append_only
Revises: 0013_audit_action_at
Create Date: 2026-12-05

``audit_checkpoints`` holds the signed statements ``cgstore audit verify``
checks the chain against; nothing in the store updates or deletes one (a
checkpoint is inserted once, ``audit.chain.checkpoint``). Like
``audit_events`` (revision 0003), the database now refuses UPDATE and DELETE
on it on both dialects, and TRUNCATE on PostgreSQL: removing a checkpoint to
hide an edit made since it needs the triggers out of the way first. The one
``audit_head`` row is updated by every append, so it only refuses DELETE (and
TRUNCATE): the chain's appends queue on that row.
"""

from __future__ import annotations

from alembic import op

revision = "0014_checkpoints_append_only"
down_revision = "0013_audit_action_at"
branch_labels = None
depends_on = None

_PG_FUNCTION = """
CREATE FUNCTION audit_chain_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only (% refused)', TG_TABLE_NAME, TG_OP;
END
$$
"""
#: name -> (operations, table, level)
_PG_TRIGGERS = {
    "audit_checkpoints_no_change": ("UPDATE OR DELETE", "audit_checkpoints", "ROW"),
    "audit_checkpoints_no_truncate": ("TRUNCATE", "audit_checkpoints", "STATEMENT"),
    "audit_head_no_delete": ("DELETE", "audit_head", "ROW"),
    "audit_head_no_truncate": ("TRUNCATE", "audit_head", "STATEMENT"),
}
_SQLITE_TRIGGERS = {
    "audit_checkpoints_no_update": ("UPDATE", "audit_checkpoints"),
    "audit_checkpoints_no_delete": ("DELETE", "audit_checkpoints"),
    "audit_head_no_delete": ("DELETE", "audit_head"),
}


def _is_postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if _is_postgres():
        op.execute(_PG_FUNCTION)
        for name, (operations, table, level) in _PG_TRIGGERS.items():
            op.execute(f"CREATE TRIGGER {name} BEFORE {operations} ON {table} "
                       f"FOR EACH {level} EXECUTE FUNCTION audit_chain_append_only()")
    else:
        for name, (operation, table) in _SQLITE_TRIGGERS.items():
            op.execute(f"CREATE TRIGGER {name} BEFORE {operation} ON {table} "
                       f"BEGIN SELECT RAISE(ABORT, '{table} is append-only ({operation} refused)'); END")


def downgrade() -> None:
    if _is_postgres():
        for name, (_, table, _) in reversed(_PG_TRIGGERS.items()):
            op.execute(f"DROP TRIGGER {name} ON {table}")
        op.execute("DROP FUNCTION audit_chain_append_only()")
    else:
        for name in reversed(_SQLITE_TRIGGERS):
            op.execute(f"DROP TRIGGER {name}")
