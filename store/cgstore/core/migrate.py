"""Run the Alembic revisions in ``migrations/`` programmatically (no alembic.ini needed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError

#: Read here rather than in Settings: Alembic needs it before any setting is parsed.
MIGRATIONS_DIR_ENV = "CGSTORE_MIGRATIONS_DIR"
#: First and largest pause between connection attempts of ``wait_for_database``.
FIRST_RETRY_PAUSE_S = 0.5
MAX_RETRY_PAUSE_S = 5.0
#: A host that drops packets must not stall one attempt past the whole wait.
CONNECT_TIMEOUT_S = 5

from cgstore.core.db import prepare_sqlite_file


def migrations_dir() -> Path:
    override = os.environ.get(MIGRATIONS_DIR_ENV)
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


def wait_for_database(url: str, wait_s: float) -> None:
    """Connect to ``url`` until it answers, for at most ``wait_s`` seconds (then re-raise).

    A one-shot migration started next to a database that is still initialising
    (docker-compose's first ``up``) must not fail on the first refused connection.
    A SQLite file has nothing to wait for.
    """
    if wait_s <= 0 or url.startswith("sqlite"):
        return
    deadline = time.monotonic() + wait_s
    pause = FIRST_RETRY_PAUSE_S
    engine = create_engine(url, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    try:
        while True:
            try:
                with engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1")
                return
            except OperationalError:
                if time.monotonic() + pause > deadline:
                    raise
            time.sleep(pause)
            pause = min(pause * 2, MAX_RETRY_PAUSE_S)
    finally:
        engine.dispose()


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
