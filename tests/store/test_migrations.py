"""The hand-written Alembic revisions: run on SQLite and PostgreSQL, and match the models."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from cgstore.core import migrate
from cgstore.models import Base
from tests.support import services


@pytest.fixture(params=["sqlite", "postgres"])
def empty_database(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'migrations.sqlite3'}"
    else:
        with services.postgres_database("cgstore_migrations") as url:
            yield url


def schema_differences(url: str) -> list:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()


def test_upgrade_creates_exactly_the_models_schema(empty_database):
    migrate.upgrade(empty_database)
    assert migrate.is_current(empty_database)
    assert schema_differences(empty_database) == []


def test_downgrade_to_base_and_back(empty_database):
    migrate.upgrade(empty_database)
    migrate.alembic_downgrade(empty_database, "base")
    engine = create_engine(empty_database)
    try:
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    finally:
        engine.dispose()
    migrate.upgrade(empty_database)
    assert schema_differences(empty_database) == []
