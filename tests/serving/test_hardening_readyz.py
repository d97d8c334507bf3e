"""Issue 9, class 4: ``/readyz`` says in its body what its status says, and a read-only database is not ready.

A database that answers ``SELECT 1`` but refuses writes would fail every upload,
so readiness probes for writes: on SQLite a file opened read-only, on PostgreSQL
a database whose sessions default to read-only transactions (a database this
test creates, so the session's shared one is never touched).
"""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import create_engine, text

from cgstore.core import migrate
from cgstore.settings import Settings
from tests.support import services
from tests.support.live_store import running_store, settings_for


def test_ready_store_says_ok_in_body_and_status(store):
    ready = httpx.get(f"{store.base_url}/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "checks": {"database": "ok", "storage": "ok"}}


def _assert_not_ready(base_url: str) -> None:
    answer = httpx.get(f"{base_url}/readyz")
    assert answer.status_code == 503
    assert answer.headers["retry-after"]
    body = answer.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["storage"] == "ok"
    assert body["checks"]["database"].startswith("unavailable")


def test_read_only_sqlite_database_is_not_ready(tmp_path):
    writable = Settings(home=tmp_path, reaper_interval_s=3600)
    migrate.upgrade(writable.resolved_database_url)
    db_file = tmp_path / "cgstore.sqlite3"
    read_only = Settings(
        home=tmp_path, reaper_interval_s=3600, database_url=f"sqlite:///file:{db_file}?mode=ro&uri=true"
    )
    with running_store(read_only, "embedded") as live:
        _assert_not_ready(live.base_url)


@pytest.fixture
def read_only_pg_url():
    """A fresh, migrated database whose sessions are read-only from the start."""
    with services.postgres_database("cgstore_readonly") as url:
        migrate.upgrade(url)
        name = url.rsplit("/", 1)[1]
        admin = create_engine(services.PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'))
        admin.dispose()
        yield url


def test_read_only_postgres_database_is_not_ready(read_only_pg_url, s3_server, tmp_path):
    settings = settings_for("production", tmp_path, pg_url=read_only_pg_url, s3=s3_server)
    with running_store(settings, "production") as live:
        _assert_not_ready(live.base_url)
