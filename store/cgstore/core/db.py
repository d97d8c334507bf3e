"""Database engine, session factory and the declarative ``Base`` every model uses.

PostgreSQL in production, SQLite as the embedded default: the models use only
portable column types, and the SQLite connection is tuned (WAL, foreign keys,
busy timeout) so that several threads of one server share it safely.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import (
    ColumnElement,
    DateTime,
    MetaData,
    String,
    any_,
    bindparam,
    cast,
    create_engine,
    event,
    make_url,
    text,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

from cgstore.core.private import private_dir, private_file

# Stable constraint names, so Alembic revisions can refer to them on both dialects.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC timestamp on both dialects (SQLite stores naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(dt.UTC)

    def process_result_value(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def prepare_sqlite_file(url: str) -> None:
    """Create a SQLite database file, and its directory, private before SQLite creates it.

    SQLite gives its -wal and -shm files the database file's mode, so a 0600
    database keeps its journals private too. Not a SQLite file URL: nothing to do.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:") or parsed.query.get("uri"):
        return
    path = Path(parsed.database)
    private_dir(path.parent)
    private_file(path)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        prepare_sqlite_file(url)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _tune_sqlite)
        return engine
    # pool_pre_ping: a connection dropped by a database restart is replaced, not reused.
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20, pool_timeout=10)


def _tune_sqlite(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


class ReadOnlyDatabase(Exception):
    """The database answers but refuses writes (reported by readiness, never to a client)."""


class Database:
    """The engine plus a session factory; one per app."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A unit of work: committed on success, rolled back on any error."""
        with self._sessions() as session:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """A connection for a read that is one statement: autocommit, so no BEGIN and COMMIT round trips.

        A single statement sees one snapshot either way; reads that need several
        statements to agree take a ``session()``.
        """
        with self._autocommit.connect() as conn:
            yield conn

    def ping(self) -> None:
        """Raise unless the database answers *and accepts writes*.

        A read-only database (a standby, ``default_transaction_read_only``, a
        SQLite file opened read-only) answers ``SELECT 1`` but would fail every
        upload, so it is not ready.
        """
        with self.engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                # No write needed: PostgreSQL says so, without locks or dead rows.
                if conn.exec_driver_sql("SHOW transaction_read_only").scalar() == "on":
                    raise ReadOnlyDatabase("the database is read-only")
            else:
                # SQLite has no such flag: a no-op write, rolled back when the block exits.
                conn.exec_driver_sql("UPDATE alembic_version SET version_num = version_num")

    def dispose(self) -> None:
        self.engine.dispose()


def plan_without_values(session: Session) -> None:
    """Plan the rest of this transaction's statements generically on PostgreSQL (no-op on SQLite).

    A plan chosen from a bound value's statistics (a digest that many records
    share, most of them another tenant's) differs from the plan of a value few
    rows have, and so takes a different time although the caller reads the
    same nothing in both: a search whose work must not depend on what the
    caller cannot see plans without its values.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL plan_cache_mode = force_generic_plan"))


def in_values(session: Session, column, values: list):
    """``column IN values`` as one statement with a constant text, whatever ``len(values)``.

    On PostgreSQL ``column = ANY(CAST(:literal AS type[]))``: one bound array
    literal instead of one placeholder per value, so neither SQLAlchemy nor the
    driver re-renders and re-parses a 256-placeholder statement on every call;
    and the literal is one joined string, not an array the driver dumps element
    by element in Python. SQLite has no arrays: an expanding IN there.
    """
    if session.get_bind().dialect.name == "postgresql":
        return column == any_(pg_array(values, column.type))
    return column.in_(list(values))


def pg_array(values: list, item_type) -> ColumnElement:
    """A PostgreSQL array of ``item_type`` (a SQLAlchemy type) bound as one literal (see ``in_values``)."""
    from sqlalchemy.dialects.postgresql import ARRAY

    return cast(bindparam(None, _pg_array_literal(values), type_=String()), ARRAY(item_type))


def _pg_array_literal(values: list) -> str:
    """A PostgreSQL array literal of ints or strings (each string quoted, ``"`` and ``\\`` escaped)."""
    if all(isinstance(value, int) and not isinstance(value, bool) for value in values):
        return "{" + ",".join(map(str, values)) + "}"
    return "{" + ",".join('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"' for value in values) + "}"


def insert_ignoring_conflicts(session: Session, model: type[Base], **values) -> bool:
    """INSERT … ON CONFLICT DO NOTHING on both dialects; True when a row was inserted.

    Two requests creating the same repo, blob or link at once both succeed and
    leave one row, without a failed transaction on either side.
    """
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    # RETURNING, not rowcount: psycopg reports rowcount 1 for an INSERT that
    # ON CONFLICT DO NOTHING skipped; a returned row is the only reliable answer.
    key = next(iter(model.__table__.primary_key.columns))
    result = session.execute(insert(model).values(**values).on_conflict_do_nothing().returning(key))
    return result.first() is not None
