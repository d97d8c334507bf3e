"""The audit table is append-only, and an entry lives and dies with the transaction it records."""

from __future__ import annotations

import pytest
import sqlalchemy.exc
from hypothesis import HealthCheck, given, settings
from sqlalchemy import delete, func, select, text, update

from cgstore.audit.models import TARGET_LEN, AuditEvent
from cgstore.audit.service import record
from cgstore.core import migrate
from cgstore.core.db import Database
from tests.audit.conftest import rows
from tests.audit.test_clean import HOSTILE
from tests.support.live_store import unique_repo


def _write(store, target: str) -> AuditEvent:
    with store.context.db.session() as session:
        record(session, actor="tester", jti=None, action="test.append", target=target)
    return rows(store, AuditEvent.target == target)[0]


@pytest.mark.parametrize(
    "statement",
    [
        lambda event: update(AuditEvent).where(AuditEvent.id == event.id).values(outcome="ok-rewritten"),
        lambda event: delete(AuditEvent).where(AuditEvent.id == event.id),
    ],
    ids=["update", "delete"],
)
def test_the_database_refuses_to_change_an_entry(store, statement):
    event = _write(store, unique_repo("append-only"))
    with pytest.raises(sqlalchemy.exc.DBAPIError, match="append-only"):
        with store.context.db.session() as session:
            session.execute(statement(event))
    assert [row.outcome for row in rows(store, AuditEvent.id == event.id)] == ["ok"]


def test_truncate_is_refused_on_postgresql(pg_url):
    """(SQLite has no TRUNCATE: its DELETE trigger, above, covers ``DELETE FROM`` without WHERE too.)"""
    migrate.upgrade(pg_url)
    db = Database(pg_url)
    try:
        with db.session() as session:
            record(session, actor="tester", jti=None, action="test.truncate", target=unique_repo("truncate"))
        with pytest.raises(sqlalchemy.exc.DBAPIError, match="append-only"):
            with db.session() as session:
                session.execute(text("TRUNCATE audit_events"))
        with db.session() as session:
            assert session.scalar(select(func.count()).select_from(AuditEvent)) > 0
    finally:
        db.dispose()


def test_an_entry_rolls_back_with_the_mutation_it_records(store):
    target = unique_repo("rolled-back")
    with pytest.raises(RuntimeError):
        with store.context.db.session() as session:
            record(session, actor="tester", jti=None, action="test.rollback", target=target)
            session.flush()  # the row reached the database inside the transaction...
            raise RuntimeError("the mutation failed")
    assert rows(store, AuditEvent.target == target) == []  # ...and left with it


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=HOSTILE)
def test_any_text_is_storable_on_both_databases(store, value):
    """NUL, lone surrogates, control characters, overlong values: the insert never fails."""
    marker = unique_repo("hostile")
    with store.context.db.session() as session:
        record(
            session,
            actor=value,
            jti=value,
            action=value,
            target=marker + value,
            repo=value,
            outcome=value,
            source=value,
            detail={value: value},
        )
    (stored,) = rows(store, AuditEvent.target.startswith(marker))
    assert len(stored.target) <= TARGET_LEN
