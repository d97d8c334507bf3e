"""Run the Alembic revisions in ``migrations/`` programmatically (no alembic.ini needed)."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine

from cgstore.core.db import prepare_sqlite_file


def migrations_dir() -> Path:
    override = os.environ.get("CGSTORE_MIGRATIONS_DIR")
    if override:
        return Path(override)
    # store/cgstore/core/migrate.py -> the repository root holds migrations/.
    return Path(__file__).resolve().parents[3] / "migrations"


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # ConfigParser interpolation would eat '%' in passwords.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    prepare_sqlite_file(url)
    command.upgrade(alembic_config(url), revision)


def is_current(url: str) -> bool:
    """True when the database is at the newest revision."""
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision() == head
    finally:
        engine.dispose()


def alembic_downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)
