"""Every denial is audited: 401s aggregated per source (no database write per request), others one row each.

Issue 9, class 9 (unauthenticated writes amplify) and the audit half of class 3
(NUL and other bytes PostgreSQL refuses), on both configurations.
"""

from __future__ import annotations

import contextlib
import time

import anyio
import blake3
import pytest
import sqlalchemy.exc
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.requests import Request

from cgstore.audit.denials import AGGREGATE_ACTION, DenialLog, audit_denial
from cgstore.audit.models import AuditEvent
from cgstore.core import migrate
from cgstore.core.db import Database
from cgstore.core.errors import BlobUnknown, hidden_miss
from tests.audit.conftest import last_id, rows
from tests.support.live_store import CONFIGURATIONS, running_store, session_servers, settings_for, unique_repo

DATA = b"audited bytes"
DIGEST = "blake3:" + blake3.blake3(DATA).hexdigest()
NO_FLUSH = 3600  # an interval no test outlives: only an explicit flush (or shutdown) writes


@pytest.fixture
def start_store(request, tmp_path_factory):
    """``with start_store("production", audit_interval_s=…) as live:`` — a store of its own, stopped on exit."""

    @contextlib.contextmanager
    def start(configuration: str, **overrides):
        home = tmp_path_factory.mktemp(f"audit-{configuration}")
        servers = session_servers(request, configuration)
        with running_store(settings_for(configuration, home, **servers, **overrides), configuration) as live:
            yield live

    return start


def _table_size(live) -> int:
    with live.context.db.session() as session:
        return session.scalar(select(func.count()).select_from(AuditEvent))


def _flood(live, name: str, n: int) -> None:
    """``n`` 401s: half without a token, half with garbage ones."""
    with live.client() as client:
        for i in range(n):
            headers = {"Authorization": f"Bearer garbage-{i}"} if i % 2 else {}
            answer = client.get(f"/v1/repos/acme/{name}/blobs/{DIGEST}", headers=headers)
            assert answer.status_code == 401


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_401s_cost_no_write_each_and_all_are_counted(start_store, configuration):
    with start_store(configuration, audit_interval_s=NO_FLUSH) as live:
        name = unique_repo("flood")
        before = _table_size(live)
        _flood(live, name, 60)
        assert _table_size(live) == before  # 60 refusals, not one row yet
        assert live.context.denials.pending == 60
        first = last_id(live)
        assert live.context.denials.flush() == 2  # one row per (source, outcome)
        written = rows(live, AuditEvent.id > first, AuditEvent.target.contains(name))
    assert {(row.outcome, row.count) for row in written} == {("UNAUTHORIZED", 30), ("TOKEN_INVALID", 30)}
    assert sum(row.count for row in written) == 60
    for row in written:
        assert (row.actor, row.jti, row.action, row.source) == ("-", None, AGGREGATE_ACTION, "127.0.0.1")
        assert row.detail["aggregated"] is True and row.detail["paths"] == [f"/v1/repos/acme/{name}/blobs/{DIGEST}"]
    messages = {row.outcome: row.detail["messages"] for row in written}
    assert messages == {
        "UNAUTHORIZED": {"this route needs a bearer token": 30},
        "TOKEN_INVALID": {"malformed token: not a JWT": 30},
    }


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_the_background_task_and_shutdown_flush(start_store, configuration):
    with start_store(configuration, audit_interval_s=0.2) as live:
        name = unique_repo("interval")
        _flood(live, name, 4)

        # The flood may straddle a flush: then its 401s are split over two rows per outcome.
        def counted() -> int:
            return sum(row.count for row in rows(live, AuditEvent.target.contains(name)))

        deadline = time.monotonic() + 10
        while counted() < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # a few more intervals: nothing is counted twice
        assert counted() == 4
        assert live.context.denials.pending == 0
    with start_store(configuration, audit_interval_s=NO_FLUSH) as live:
        name = unique_repo("shutdown")
        _flood(live, name, 3)
        db = live.context.db
    # The store has stopped: what it had counted was written on the way out.
    with db.session() as session:
        written = session.scalars(select(AuditEvent).where(AuditEvent.target.contains(name))).all()
    assert sum(row.count for row in written) == 3


def test_sources_beyond_the_bound_are_still_counted(store):
    denials = DenialLog(store.context.db, interval_s=NO_FLUSH, max_sources=2)
    marker = unique_repo("sources")
    for i in range(5):
        denials.count(source=f"10.0.0.{i}", outcome="UNAUTHORIZED", message="no token", path=f"/{marker}/{i}")
    first = last_id(store)
    assert denials.flush() == 3
    written = rows(store, AuditEvent.id > first, AuditEvent.target.contains(marker))
    assert {(row.source, row.count) for row in written} == {("10.0.0.0", 1), ("10.0.0.1", 1), ("*", 3)}


def test_a_failed_flush_keeps_the_counts(tmp_path):
    """The database refuses the insert (here: no schema yet); the counts wait, and land on the next flush."""
    url = f"sqlite:///{tmp_path / 'late-schema.sqlite3'}"
    db = Database(url)
    try:
        denials = DenialLog(db, interval_s=NO_FLUSH, max_sources=10)
        for i in range(5):
            denials.count(source="192.0.2.1", outcome="TOKEN_INVALID", message="bad", path=f"/v1/x/{i}")
        with pytest.raises(sqlalchemy.exc.OperationalError, match="no such table: audit_"):  # the head, first
            denials.flush()
        assert denials.pending == 5
        denials.count(source="192.0.2.1", outcome="TOKEN_INVALID", message="bad", path="/v1/x/late")
        migrate.upgrade(url)
        assert denials.flush() == 1 and denials.pending == 0
        with db.session() as session:
            (row,) = session.scalars(select(AuditEvent)).all()
    finally:
        db.dispose()
    assert row.count == 6 and row.detail["messages"] == {"bad": 6} and len(row.detail["paths"]) == 5


def test_403s_stay_one_row_each_with_actor_repo_and_source(store):
    name = unique_repo("denied")
    token = store.mint("mallory", f"acme/{unique_repo()}:read,write")
    first = last_id(store)
    with store.client(token) as client:
        for _ in range(3):
            assert client.put(f"/v1/repos/acme/{name}/blobs/{DIGEST}", content=DATA).status_code == 403
    written = rows(store, AuditEvent.id > first, AuditEvent.repo == f"acme/{name}")
    assert len(written) == 3
    for row in written:
        assert (row.actor, row.outcome, row.count, row.source) == ("mallory", "DENIED", 1, "127.0.0.1")
        assert row.action == "PUT /v1/repos/{owner}/{repo}/blobs/{digest}" and row.jti


def test_a_401_with_nul_in_the_path_is_audited(store):
    name = unique_repo("nul")
    with store.client() as client:
        answer = client.get(f"/v1/repos/acme/{name}%00evil/blobs/{DIGEST}")
    assert answer.status_code == 401
    store.context.denials.flush()
    written = [
        row
        for row in rows(store, AuditEvent.outcome == "UNAUTHORIZED")
        if any(f"{name}\\x00evil" in path for path in row.detail.get("paths", [])) or f"{name}\\x00evil" in row.target
    ]
    assert written


def test_a_403_with_nul_in_the_path_is_audited(store):
    name = unique_repo("nul403")
    token = store.mint("mallory", f"acme/{unique_repo()}:write")
    with store.client(token) as client:
        answer = client.get(f"/v1/repos/acme/{name}/uploads/a%00b")
    assert answer.status_code == 403
    (row,) = rows(store, AuditEvent.repo == f"acme/{name}")
    assert row.target == f"/v1/repos/acme/{name}/uploads/a\\x00b" and row.outcome == "DENIED"


def test_a_hidden_404_with_nul_and_surrogates_is_audited(store):
    """No route lets NUL reach a hidden miss (names are validated first), so the hook gets the request itself."""
    name = unique_repo("nul404")
    token = store.mint("eve", "acme/elsewhere:read")
    claims = store.context.tokens.verify(token)
    app = store.server.config.app
    path = f"/v1/repos/acme/{name}/blobs/x\x00y\ud800"
    request = Request(
        {
            "type": "http",
            "method": "GET",
            "path": path,
            "raw_path": path.encode("utf-8", "surrogatepass"),
            "query_string": b"",
            "headers": [],
            "app": app,
            "client": ("192.0.2.7", 1234),
            "path_params": {"owner": "acme", "repo": name},
            "state": {"claims": claims},
        }
    )
    anyio.run(audit_denial, request, hidden_miss(BlobUnknown, "blob unknown to this repo \x00\ud800"))
    store.context.denials.flush()  # a hidden miss's row is deferred to the next flush
    (row,) = rows(store, AuditEvent.repo == f"acme/{name}")
    assert row.target == f"/v1/repos/acme/{name}/blobs/x\\x00y\\ud800"
    assert (row.outcome, row.actor, row.source) == ("BLOB_UNKNOWN", "eve", "192.0.2.7")
    assert row.detail == {"message": "blob unknown to this repo \\x00\\ud800"}


def test_hidden_misses_are_deferred_one_row_each_and_counted_beyond_the_bound(store):
    denials = DenialLog(store.context.db, interval_s=NO_FLUSH, max_sources=2)
    marker = unique_repo("deferred")
    for i in range(3):
        denials.defer(
            actor="bob",
            jti=f"j{i}",
            action="GET x",
            target=f"/{marker}/{i}",
            repo=f"acme/{marker}",
            outcome="NAME_UNKNOWN",
            source="192.0.2.3",
            message="no such compiled graph",
        )
    assert denials.pending == 3
    first = last_id(store)
    assert denials.flush() == 3 and denials.pending == 0
    written = rows(store, AuditEvent.id > first, AuditEvent.target.contains(marker))
    assert sorted((row.jti or "", row.count, row.repo or "") for row in written) == [
        ("", 1, ""),
        ("j0", 1, f"acme/{marker}"),
        ("j1", 1, f"acme/{marker}"),
    ]
    assert all((row.actor, row.outcome, row.source) == ("bob", "NAME_UNKNOWN", "192.0.2.3") for row in written)


def test_a_probe_decides_at_the_flush_whether_a_miss_hid_a_denial(store):
    """A private cache's miss carries a probe (``maybe_hidden_miss``) the flush runs in its own session:
    a row only where the probe finds another principal's item; an absent miss is dropped."""
    denials = DenialLog(store.context.db, interval_s=NO_FLUSH, max_sources=10)
    marker = unique_repo("probed")
    asked: list[str] = []

    def probe(answer: bool, name: str):
        def ask(session, at) -> bool:
            assert isinstance(session, Session) and session.is_active  # the flush's own session
            asked.append(name)
            return answer

        return ask

    for name, answer in [("hidden", True), ("absent", False), ("plain-absent", False)]:
        hidden = probe(answer, name) if name != "plain-absent" else False
        denials.defer(
            actor="bob",
            jti=name,
            action="HEAD x",
            target=f"/{marker}/{name}",
            repo=f"acme/{marker}",
            outcome="BLOB_UNKNOWN",
            source="192.0.2.4",
            message="blob unknown to this repo",
            hidden=hidden,
        )
    assert asked == []  # nothing asked on the request path
    first = last_id(store)
    assert denials.flush() == 1 and denials.pending == 0
    assert asked == ["hidden", "absent"]  # the plain absent miss needs no question
    written = rows(store, AuditEvent.id > first, AuditEvent.target.contains(marker))
    assert [(row.jti, row.target) for row in written] == [("hidden", f"/{marker}/hidden")]


def test_a_failed_flush_keeps_the_probed_misses(tmp_path):
    """No schema yet: the flush fails, the probed row waits for the next one, which writes it."""
    url = f"sqlite:///{tmp_path / 'late-schema.sqlite3'}"
    db = Database(url)
    try:
        denials = DenialLog(db, interval_s=NO_FLUSH, max_sources=10)
        denials.defer(
            actor="bob",
            jti="j",
            action="GET x",
            target="/acme/x",
            repo="acme/x",
            outcome="NAME_UNKNOWN",
            source="192.0.2.5",
            message="no such compiled graph",
            hidden=lambda session, at: True,
        )
        with pytest.raises(sqlalchemy.exc.OperationalError, match="no such table: audit_"):
            denials.flush()
        assert denials.pending == 1
        migrate.upgrade(url)
        assert denials.flush() == 1 and denials.pending == 0
        with db.session() as session:
            (row,) = session.scalars(select(AuditEvent)).all()
    finally:
        db.dispose()
    assert (row.jti, row.outcome, row.count) == ("j", "NAME_UNKNOWN", 1)


def test_an_aggregate_keeps_bounded_samples_of_huge_paths(store):
    denials = DenialLog(store.context.db, interval_s=NO_FLUSH, max_sources=10)
    marker = unique_repo("huge")
    for i in range(20):
        denials.count(
            source="192.0.2.9",
            outcome="UNAUTHORIZED",
            message="m" * 10_000 + str(i),
            path=f"/{marker}/{i}" + "p" * 100_000,
        )
    first = last_id(store)
    denials.flush()
    (row,) = rows(store, AuditEvent.id > first, AuditEvent.target.contains(marker))
    assert row.count == 20 and len(row.target) == 512 and row.target.endswith("…[cut from 513 chars]")
    assert len(row.detail["paths"]) == 5 and all(len(path) == 512 for path in row.detail["paths"])
    assert sum(row.detail["messages"].values()) <= 20 and len(row.detail["messages"]) <= 8
