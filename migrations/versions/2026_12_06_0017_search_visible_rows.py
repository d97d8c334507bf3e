"""Resolve and discover touch only the rows the caller may read: their indexes end in ``(repo_id, publisher)``.

Revision ID: 0017_search_visible_rows
Revises: 0016_audit_chain_start
Create Date: 2026-12-06

Issue 30 §2: discover loaded every live row of a declaration, across all
tenants, and filtered them in Python, so an answer took longer when records
the caller cannot read matched (9.6 ms against 3.7 ms with 404 of them), and
anyone could slow everyone's discover by copying one record into many repos.
Resolve did the same per key. Both now plan the repos they search first
(``access.searched_repos``) and read each one's rows through an index led by
what they match on, then the repo and, in a private cache, the reader as
publisher:

- ``ix_compiled_graphs_resolve``: ``(key, family)`` becomes ``(key, family, repo_id, publisher)``;
- ``ix_compiled_graphs_discover``: ``(discovery_digest, binding_signature, release)`` becomes
  ``(discovery_digest, repo_id, publisher)`` (release, binding signature and code now narrow
  only the rows the caller may read).

Both stay partial over live rows. Each rebuild reads the table once; on
PostgreSQL it blocks writes to ``compiled_graphs`` while it runs.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017_search_visible_rows"
down_revision = "0016_audit_chain_start"
branch_labels = None
depends_on = None

_LIVE = sa.text("yanked_at IS NULL")
_TABLE = "compiled_graphs"


def _rebuild(name: str, columns: list[str]) -> None:
    op.drop_index(name, table_name=_TABLE)
    op.create_index(name, _TABLE, columns, sqlite_where=_LIVE, postgresql_where=_LIVE)


def upgrade() -> None:
    _rebuild("ix_compiled_graphs_resolve", ["key", "family", "repo_id", "publisher"])
    _rebuild("ix_compiled_graphs_discover", ["discovery_digest", "repo_id", "publisher"])


def downgrade() -> None:
    _rebuild("ix_compiled_graphs_discover", ["discovery_digest", "binding_signature", "release"])
    _rebuild("ix_compiled_graphs_resolve", ["key", "family"])
