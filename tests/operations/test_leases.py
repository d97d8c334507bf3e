"""Leases: one holder at a time on PostgreSQL and SQLite, takeover after expiry, and after a SIGKILL."""

from __future__ import annotations

import datetime as dt
import os
import signal
import threading
import time

import pytest
from sqlalchemy import select

from cgstore.core import migrate
from cgstore.core.db import Database, utcnow
from cgstore.operations import leases
from cgstore.operations.leases import LeaseLost
from cgstore.operations.models import Lease
from tests.support import services


@pytest.fixture(params=["sqlite", "postgres"])
def db(request, tmp_path, pg_url):
    url = f"sqlite:///{tmp_path / 'leases.sqlite3'}" if request.param == "sqlite" else pg_url
    migrate.upgrade(url)
    database = Database(url)
    yield database
    database.dispose()


def fresh_name() -> str:
    return f"task-{os.urandom(4).hex()}"


def test_one_holder_until_expiry_then_a_new_generation(db):
    name = fresh_name()
    first = leases.acquire(db, name, "a", ttl_s=60)
    assert first is not None and first.generation == 1
    assert leases.acquire(db, name, "b", ttl_s=60) is None
    again = leases.acquire(db, name, "a", ttl_s=60)
    assert again is not None and again.generation == 1  # a renewal, not a takeover
    later = utcnow() + dt.timedelta(seconds=61)
    taken = leases.acquire(db, name, "b", ttl_s=60, now=later)
    assert taken is not None and taken.generation == 2
    with pytest.raises(LeaseLost):
        first.renew()
    assert leases.acquire(db, name, "a", ttl_s=60, now=later) is None


def test_release_hands_over_at_once_and_keeps_the_cursor(db):
    name = fresh_name()
    held = leases.acquire(db, name, "a", ttl_s=600)
    held.save_cursor("blake3:" + "ab" * 32)
    held.release()
    successor = leases.acquire(db, name, "b", ttl_s=600)
    assert successor is not None
    assert successor.cursor == "blake3:" + "ab" * 32
    with pytest.raises(LeaseLost):
        held.save_cursor("blake3:" + "cd" * 32)


def test_racing_acquirers_get_exactly_one_lease(db):
    name = fresh_name()
    contenders = 8
    barrier = threading.Barrier(contenders)
    results: dict[str, object] = {}

    def contend(holder: str) -> None:
        barrier.wait()
        results[holder] = leases.acquire(db, name, holder, ttl_s=60)

    threads = [threading.Thread(target=contend, args=(f"h{i}",)) for i in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    winners = [holder for holder, lease in results.items() if lease is not None]
    assert len(results) == contenders and len(winners) == 1
    with db.session() as session:
        assert session.scalar(select(Lease.holder).where(Lease.name == name)) == winners[0]


def test_racing_takeovers_of_an_expired_lease_get_exactly_one(db):
    name = fresh_name()
    assert leases.acquire(db, name, "dead", ttl_s=1) is not None
    later = utcnow() + dt.timedelta(seconds=5)
    barrier = threading.Barrier(6)
    results = {}

    def contend(holder: str) -> None:
        barrier.wait()
        results[holder] = leases.acquire(db, name, holder, ttl_s=60, now=later)

    threads = [threading.Thread(target=contend, args=(f"t{i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    winners = [lease for lease in results.values() if lease is not None]
    assert len(winners) == 1 and winners[0].generation == 2


# -- two store processes and a SIGKILL -----------------------------------------------------


def reaper_holder(db: Database) -> str | None:
    with db.session() as session:
        row = session.get(Lease, leases.UPLOAD_REAPER)
        return row.holder if row is not None and row.expires_at > utcnow() else None


def wait_for(predicate, timeout_s: float) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError("condition not reached")
        time.sleep(0.05)
    return time.monotonic() - started


def pid_of(holder: str | None) -> int | None:
    return int(holder.split(":")[-2]) if holder else None


def test_the_reaper_runs_on_one_replica_and_moves_when_its_holder_is_killed(pg_url, s3_server, tmp_path):
    ttl_s = 2.0
    bucket = s3_server.create_bucket()
    env = {
        "CGSTORE_DATABASE_URL": pg_url,
        "CGSTORE_STORAGE_URL": s3_server.storage_url(bucket),
        "CGSTORE_REAPER_INTERVAL_S": "0.2",
        "CGSTORE_LEASE_TTL_S": str(ttl_s),
        "CGSTORE_TOKEN_SIGNING_KEY": str(tmp_path / "key.pem"),
    }
    db = Database(pg_url)
    try:
        with services.store_process(env, tmp_path / "a") as first:
            wait_for(lambda: pid_of(reaper_holder(db)) == first.process.pid, timeout_s=20)
            with services.store_process(env, tmp_path / "b") as second:
                # Both alive, several rounds each: the lease never leaves its holder.
                deadline = time.monotonic() + 3 * ttl_s
                while time.monotonic() < deadline:
                    assert pid_of(reaper_holder(db)) == first.process.pid
                    time.sleep(0.1)
                first.process.send_signal(signal.SIGKILL)
                first.process.wait(10)
                took = wait_for(lambda: pid_of(reaper_holder(db)) == second.process.pid, timeout_s=ttl_s + 10)
                assert took <= ttl_s + 2.0
    finally:
        db.dispose()


def test_cli_reap_takes_the_reaper_lease_and_lets_it_go(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cgstore.cli import app as cli

    url = f"sqlite:///{tmp_path / 'home' / 'cgstore.sqlite3'}"
    migrate.upgrade(url)
    monkeypatch.setenv("CGSTORE_HOME", str(tmp_path / "home"))
    db = Database(url)
    try:
        held = leases.acquire(db, leases.UPLOAD_REAPER, "a-server", ttl_s=600)
        busy = CliRunner().invoke(cli, ["uploads", "reap"])
        assert busy.exit_code == 1 and "holds the upload-reaper lease" in busy.output
        held.release()
        done = CliRunner().invoke(cli, ["uploads", "reap"])
        assert done.exit_code == 0 and "reaped 0 sessions" in done.output
        # Released again at once: the server's next round need not wait for the expiry.
        assert leases.acquire(db, leases.UPLOAD_REAPER, "a-server", ttl_s=600) is not None
    finally:
        db.dispose()
