"""An audit page filtered by an action prefix is read action by action: ``(action, id)``, code-point order.

Revision ID: 0015_audit_action_pages
Revises: 0014_checkpoints_append_only
Create Date: 2026-12-05

``GET /v1/audit?action=key.*`` (and the console's audit form) matched the
prefix with ``LIKE``, which neither database answered from an index (SQLite's
``LIKE`` ignores case; PostgreSQL uses a btree for it only under the "C"
collation), so the newest-first page walked the log by id testing every entry:
a prefix no entry has read all of it (207 ms on SQLite, 129 ms on PostgreSQL at
1 M entries). ``audit.service`` now lists the prefix's distinct actions by a
skip scan of the action index and reads each one's page from
``(action, id)``.

Two changes make that exact and cheap:
- ``audit_events.action`` compares by code point on PostgreSQL (``COLLATE
  "C"``), as it already does on SQLite (BINARY), so the actions sharing a
  prefix are contiguous in the index whatever the database's default
  collation. Actions are stored escaped to ASCII (``audit.service.clean``), so
  only the order of punctuation changes; equality is unchanged.
- a new index ``(action, id)``: one action's entries in id order, so its
  newest page is the index's last ``limit`` entries. ``(action, at)`` stays
  for the overview's windows (an action since a moment).

Changing the collation rebuilds the indexes on ``action`` and the new index
reads the table once; on PostgreSQL both block appends to the audit log while
they run (seconds per million entries on this project's machines).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_audit_action_pages"
down_revision = "0014_checkpoints_append_only"
branch_labels = None
depends_on = None

_ACTION_LEN = 128


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column(
            "audit_events", "action",
            type_=sa.String(_ACTION_LEN, collation="C"), existing_type=sa.String(_ACTION_LEN), existing_nullable=False,
        )
    op.create_index("ix_audit_events_action_id", "audit_events", ["action", "id"])


def downgrade() -> None:
    op.drop_index("ix_audit_events_action_id", table_name="audit_events")
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column(
            "audit_events", "action",
            type_=sa.String(_ACTION_LEN), existing_type=sa.String(_ACTION_LEN, collation="C"), existing_nullable=False,
        )
