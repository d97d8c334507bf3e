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


def test_0012_backfills_discovery_digests_and_leaves_binding_signatures_null(empty_database):
    """A record published before discovery is found by its declaration, never by a binding signature."""
    import datetime as dt
    import json

    from sqlalchemy import text

    from cgstore_client.binding import discovery_digest

    migrate.upgrade(empty_database, "0011_audit_chain")
    now = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    envelope, toolchain = "blake3:" + "e" * 64, "blake3:" + "7" * 64
    recorded = {"diffusers": "0.35.1", "transformers": "4.57.1"}
    engine = create_engine(empty_database)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO repos (owner, name, visibility, created_by, created_at) "
                    "VALUES ('acme', 'old', 'public', 'ops', :now)"
                ),
                {"now": now},
            )
            conn.execute(
                text("INSERT INTO blobs (digest, size, created_at, linked_at) VALUES (:d, 1, :now, :now)"),
                {"d": "blake3:" + "a" * 64, "now": now},
            )
            conn.execute(
                text(
                    "INSERT INTO compiled_graphs (repo_id, key, kind, format, family, lane, sm, graph_digest, envelope, "
                    "envelope_digest, toolchain, toolchain_digest, recorded_versions, artifact_digest, artifact_size, "
                    "component_set, input_contract, binding_table, publisher, created_at, health, scope) "
                    "SELECT id, :key, 'aot-inductor', 'pt2', 'flux', 'baseline+packed', 'sm_90', :g, '{}', :e, '{}', :t, "
                    ":rec, :a, 1, :g, '{}', '[]', 'minter', :now, 'ok', '' FROM repos"
                ),
                {
                    "key": "ck1-" + "1" * 56,
                    "g": "blake3:" + "0" * 64,
                    "e": envelope,
                    "t": toolchain,
                    "rec": json.dumps(recorded),
                    "a": "blake3:" + "a" * 64,
                    "now": now,
                },
            )
        migrate.upgrade(empty_database)
        with engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT discovery_digest, binding_signature, release, code_fingerprint, "
                    "drift_reports FROM compiled_graphs"
                )
            ).one()
    finally:
        engine.dispose()
    assert tuple(row) == (discovery_digest("flux", envelope, "sm_90", toolchain, recorded), None, None, None, 0)
