"""Alembic environment: runs the revisions in ``versions/`` against the configured database.

The URL comes from the Alembic config (set by ``cgstore db upgrade`` from
``CGSTORE_DATABASE_URL``). Revisions are written by hand and reviewed; the
model metadata is attached only so ``alembic check`` can compare them.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from cgstore.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = engine_from_config(
        config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.", poolclass=pool.NullPool
    )
    with connectable.connect() as connection:
        # render_as_batch: SQLite can only ALTER through table copies.
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
