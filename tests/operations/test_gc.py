"""Garbage collection on both configurations: exactly the orphans go, in batches, dry-run first.

Each test gets a registry of its own (a fresh SQLite file + directory, or a
fresh PostgreSQL database + bucket), so "exactly" means exactly. Blobs are
seeded in bulk (rows by executemany, small objects written straight into the
backend) with link times in the past, as a registry that has run for days.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time

import blake3
import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from cgstore.blobs.models import Blob, RepoBlob, UploadSession
from cgstore.blobs.service import hold_blobs
from cgstore.cli import app as cli
from cgstore.core.db import utcnow
from cgstore.operations import gc, leases
from cgstore.settings import Settings
from cgstore.storage.fs import FileStorage
from tests.operations.gc_support import (
    GRACE_S,
    NOW,
    OLD,
    RECENT,
    Seeded,
    blob_rows,
    make_blobs,
    make_repo,
    seed_records,
    seed_rows,
    stored_digests,
    write_objects,
)
from tests.support.live_store import running_store, unique_repo

# -- 10k blobs, a third orphaned -------------------------------------------------------------


def test_exactly_the_orphans_are_reclaimed_in_batches_after_a_matching_dry_run(registry):
    live = registry
    repo_id = make_repo(live)
    blobs = make_blobs(10_000, "gc")
    recently_linked = blobs[1::6]  # kept: linked within the grace
    young_link = blobs[2::6] + blobs[4::6]  # kept: linked long ago, but a repo link is young
    in_records = blobs[5::6]  # kept: linked long ago, named by a live record
    orphans = blobs[0::3]  # 3334: nothing keeps them
    linked_orphans, bare_orphans = orphans[::2], orphans[1::2]
    seed_rows(live, recently_linked, RECENT)
    seed_rows(live, young_link, OLD, repo_id, link_created_at=RECENT)
    seed_rows(live, in_records, OLD, repo_id, link_created_at=OLD)
    seed_records(live, repo_id, [b.digest for b in in_records])
    seed_rows(live, linked_orphans, OLD, repo_id, link_created_at=OLD)
    seed_rows(live, bare_orphans, OLD)
    # Every orphan's object but ten (already gone: deleting them still counts as done),
    # and a tenth of the kept ones as witnesses that survive (all 10k would cost S3 tens of seconds).
    already_missing = {b.digest for b in bare_orphans[:10]}
    witnesses = recently_linked[::10] + young_link[::10] + in_records[::10]
    write_objects(live, [b for b in orphans if b.digest not in already_missing] + witnesses)
    orphan_digests = {b.digest for b in orphans}
    kept = {b.digest for b in blobs} - orphan_digests
    witness_digests = {b.digest for b in witnesses}

    dry = gc.collect(live.context, dry_run=True, now=NOW, grace_s=GRACE_S, batch_size=500)
    assert set(dry.blobs) == orphan_digests and len(dry.blobs) == 3334
    assert blob_rows(live) == kept | orphan_digests  # a dry run deletes nothing
    assert stored_digests(live) == (orphan_digests - already_missing) | witness_digests

    real = gc.collect(live.context, now=NOW, grace_s=GRACE_S, batch_size=500)
    assert real.blobs == dry.blobs  # the same set, in the same order
    assert real.batches == [500] * 6 + [334]
    assert real.bytes == sum(len(b.data) for b in orphans)
    assert blob_rows(live) == kept
    assert stored_digests(live) == witness_digests
    with live.context.db.session() as session:
        links = session.scalar(select(func.count()).select_from(RepoBlob).where(RepoBlob.repo_id == repo_id))
        assert links == len(young_link) + len(in_records)

    again = gc.collect(live.context, now=NOW, grace_s=GRACE_S, batch_size=500)
    assert again.blobs == [] and blob_rows(live) == kept


# -- resuming, visibility, the lease ---------------------------------------------------------


def test_a_run_that_died_after_condemning_is_finished_by_the_next(registry):
    live = registry
    blobs = make_blobs(30, "resume")
    seed_rows(live, blobs, OLD)
    write_objects(live, blobs)
    cutoff = NOW - dt.timedelta(seconds=GRACE_S)
    condemned = gc.condemn(live.context, [b.digest for b in blobs[:10]], cutoff, NOW)
    assert len(condemned) == 10  # ... and the process died here, before deleting anything

    dry = gc.collect(live.context, dry_run=True, now=NOW, grace_s=GRACE_S, batch_size=7)
    report = gc.collect(live.context, now=NOW, grace_s=GRACE_S, batch_size=7)
    assert sorted(dry.blobs) == sorted(report.blobs) == sorted(b.digest for b in blobs)
    assert report.batches[:2] == [7, 3]  # the unfinished ten first, in batches too
    assert blob_rows(live) == set() and stored_digests(live) == set()


def test_a_condemned_blob_reads_as_absent_and_cannot_be_relinked(registry):
    live = registry
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write")
    data = b"condemned bytes"
    digest = "blake3:" + blake3.blake3(data).hexdigest()
    with live.client(token) as client:
        assert client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data).status_code == 201
        # Make it old enough, then condemn it (a GC run between its steps).
        with live.context.db.session() as session:
            session.execute(Blob.__table__.update().where(Blob.digest == digest).values(linked_at=OLD))
            session.execute(RepoBlob.__table__.update().where(RepoBlob.digest == digest).values(created_at=OLD))
        assert gc.condemn(live.context, [digest], NOW - dt.timedelta(seconds=GRACE_S), NOW) == [digest]
        assert client.head(f"/v1/repos/acme/{name}/blobs/{digest}").status_code == 404
        missing = client.post(f"/v1/repos/acme/{name}/blobs:missing", json={"digests": [digest]})
        assert missing.json() == {"missing": [digest]}
        again = client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data)
        assert again.status_code == 503 and again.json()["error"]["code"] == "UNAVAILABLE"
        # Once GC finished, the same bytes upload afresh.
        gc.collect(live.context, now=NOW, grace_s=GRACE_S)
        assert client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data).status_code == 201
        assert client.get(f"/v1/repos/acme/{name}/blobs/{digest}", follow_redirects=True).content == data


def test_gc_saves_its_cursor_in_the_lease_and_a_successor_resumes_there(registry):
    live = registry
    blobs = sorted(make_blobs(20, "cursor"), key=lambda b: b.digest)
    seed_rows(live, blobs, OLD)
    write_objects(live, blobs)
    lease = leases.acquire(live.context.db, leases.GC, "first", ttl_s=60)
    lease.save_cursor(blobs[9].digest)  # the first holder got this far, then died
    successor = leases.acquire(live.context.db, leases.GC, "second", ttl_s=60, now=utcnow() + dt.timedelta(minutes=5))
    assert successor.cursor == blobs[9].digest
    dry = gc.collect(live.context, dry_run=True, now=NOW, grace_s=GRACE_S, batch_size=4)
    report = gc.collect(live.context, lease=successor, now=NOW, grace_s=GRACE_S, batch_size=4)
    assert report.blobs == dry.blobs == [b.digest for b in blobs[10:]]
    assert leases.acquire(live.context.db, leases.GC, "second", ttl_s=60).cursor is None  # full pass: reset


def test_expired_sessions_are_listed_by_the_dry_run_and_reaped(registry):
    live = registry
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write")
    with live.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        assert client.patch(location, content=b"x" * 1000, headers={"Content-Range": "0-999"}).status_code == 202
    session_id = location.rsplit("/", 1)[-1]
    with live.context.db.session() as session:
        session.execute(UploadSession.__table__.update().where(UploadSession.id == session_id).values(expires_at=OLD))
    dry = gc.collect(live.context, dry_run=True, now=NOW, grace_s=GRACE_S)
    assert dry.sessions == [session_id]
    report = gc.collect(live.context, now=NOW, grace_s=GRACE_S)
    assert report.sessions_reaped >= 1
    with live.context.db.session() as session:
        assert session.get(UploadSession, session_id) is None
    if live.is_s3:
        storage = live.context.storage
        assert (
            storage.client.list_objects_v2(Bucket=storage.bucket, Prefix=storage.key("uploads/")).get("KeyCount") == 0
        )


def _staged_session_ids(live) -> set[str]:
    """The sessions with staged bytes, read off the backend's listing (``uploads/<session>[/<chunk>]``)."""
    listed, cursor = [], None
    while True:
        page, cursor = live.context.storage.list_keys("uploads/", cursor)
        listed += page
        if cursor is None:
            return {item.key.split("/")[1] for item in listed}


def test_staged_uploads_no_session_names_are_dropped_after_the_grace_and_a_live_session_keeps_its_own(registry):
    live = registry
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write")
    sessions = []
    with live.client(token) as client:
        for _ in range(2):
            location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
            assert client.patch(location, content=b"x" * 1000, headers={"Content-Range": "0-999"}).status_code == 202
            sessions.append(location.rsplit("/", 1)[-1])
    orphaned, kept = sessions
    with live.context.db.session() as session:  # as if a cancel had raced an append, or a crash
        session.execute(UploadSession.__table__.delete().where(UploadSession.id == orphaned))
    grace_s = 600
    later = utcnow() + dt.timedelta(seconds=2 * grace_s)  # past the grace, before the live session expires

    within = gc.collect(live.context, grace_s=grace_s)
    assert _staged_session_ids(live) == {orphaned, kept}
    dry = gc.collect(live.context, dry_run=True, now=later, grace_s=grace_s)
    assert _staged_session_ids(live) == {orphaned, kept}  # a dry run drops nothing
    report = gc.collect(live.context, now=later, grace_s=grace_s)
    assert _staged_session_ids(live) == {kept}
    assert within.staged == [] and dry.staged == report.staged == [orphaned] and dry.summary()["staged"] == 1
    # The live session is whole: it commits.
    data = b"x" * 1000
    with live.client(token) as client:
        digest = "blake3:" + blake3.blake3(data).hexdigest()
        answer = client.put(f"/v1/repos/acme/{name}/uploads/{kept}", params={"digest": digest})
    assert answer.status_code == 201, answer.text
    assert gc.collect(live.context, now=later, grace_s=grace_s).staged == []


def test_cli_gc_dry_run_lists_what_the_real_run_deletes(registry, monkeypatch):
    live = registry
    keep, drop = make_blobs(12, "cli-keep"), make_blobs(9, "cli-drop")
    seed_rows(live, keep, RECENT)
    seed_rows(live, drop, OLD)
    write_objects(live, keep + drop)
    for key, value in {
        "CGSTORE_HOME": str(live.settings.home),
        "CGSTORE_DATABASE_URL": live.settings.resolved_database_url,
        "CGSTORE_STORAGE_URL": live.settings.resolved_storage_url,
    }.items():
        monkeypatch.setenv(key, value)
    runner = CliRunner()
    dry = runner.invoke(cli, ["gc", "--dry-run", "--grace", "1d", "--batch-size", "4"])
    assert dry.exit_code == 0, dry.output
    real = runner.invoke(cli, ["gc", "--grace", "1d", "--batch-size", "4"])
    assert real.exit_code == 0, real.output
    listed = {line.split()[-1] for line in dry.output.splitlines() if line.startswith("would delete ")}
    deleted = {line.split()[-1] for line in real.output.splitlines() if line.startswith("deleted ")}
    assert listed == deleted == {b.digest for b in drop}
    summary = json.loads(real.output.splitlines()[-1])
    assert summary["blobs"] == 9 and summary["batches"] == 3 and not summary["dry_run"]
    assert blob_rows(live) == {b.digest for b in keep}


def test_cli_gc_refuses_while_another_instance_holds_the_lease(registry, monkeypatch):
    live = registry
    monkeypatch.setenv("CGSTORE_HOME", str(live.settings.home))
    monkeypatch.setenv("CGSTORE_DATABASE_URL", live.settings.resolved_database_url)
    monkeypatch.setenv("CGSTORE_STORAGE_URL", live.settings.resolved_storage_url)
    assert leases.acquire(live.context.db, leases.GC, "busy-replica", ttl_s=600) is not None
    result = CliRunner().invoke(cli, ["gc"])
    assert result.exit_code == 1 and "holds the gc lease" in result.output


# -- publish racing GC, interleaved deterministically -------------------------------------------


@pytest.fixture
def old_orphan(registry) -> str:
    blob = make_blobs(1, f"race-{time.monotonic_ns()}")[0]
    seed_rows(registry, [blob], OLD)
    write_objects(registry, [blob])
    return blob.digest


def cutoff() -> dt.datetime:
    return NOW - dt.timedelta(seconds=GRACE_S)


def test_a_publish_that_commits_before_the_condemn_keeps_the_blob(registry, old_orphan):
    assert [d for d, _ in gc.find_candidates(registry.context, cutoff(), "", 10)] == [old_orphan]
    with registry.context.db.session() as publish:
        assert hold_blobs(publish, [old_orphan]) == set()
    assert gc.condemn(registry.context, [old_orphan], cutoff(), NOW) == []  # GC re-reads the row
    assert gc.collect(registry.context, now=NOW, grace_s=GRACE_S).blobs == []
    assert registry.context.storage.size(old_orphan) is not None


def test_a_publish_after_the_condemn_is_refused(registry, old_orphan):
    assert gc.condemn(registry.context, [old_orphan], cutoff(), NOW) == [old_orphan]
    with registry.context.db.session() as publish:
        assert hold_blobs(publish, [old_orphan]) == {old_orphan}  # the publish answers BLOB_UNKNOWN
    gc.collect(registry.context, now=NOW, grace_s=GRACE_S)
    assert registry.context.storage.size(old_orphan) is None and blob_rows(registry) == set()


def run_in_thread(function, *args) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(function(*args)), daemon=True)
    thread.start()
    return thread, result


def test_a_condemn_waits_for_an_open_publish_transaction_and_then_spares_the_blob(registry, old_orphan):
    ctx = registry.context
    with ctx.db.session() as publish:
        assert hold_blobs(publish, [old_orphan]) == set()
        # GC's conditional UPDATE of the same row blocks on the publish's write...
        thread, condemned = run_in_thread(gc.condemn, ctx, [old_orphan], cutoff(), NOW)
        thread.join(0.5)
        assert thread.is_alive() and condemned == []
    # ...and, once the publish committed, re-reads linked_at and spares the blob.
    thread.join(30)
    assert condemned == [[]]
    assert ctx.storage.size(old_orphan) is not None and blob_rows(registry) == {old_orphan}


def test_a_publish_waits_for_an_open_condemn_transaction_and_then_is_refused(registry, old_orphan):
    ctx = registry.context

    def publish() -> set[str]:
        with ctx.db.session() as session:
            return hold_blobs(session, [old_orphan])

    with ctx.db.session() as collection:
        assert gc.condemn_in(collection, [old_orphan], cutoff(), NOW) == [old_orphan]
        thread, missing = run_in_thread(publish)
        thread.join(0.5)
        assert thread.is_alive() and missing == []
    thread.join(30)
    assert missing == [{old_orphan}]
    gc.collect(ctx, now=NOW, grace_s=GRACE_S)
    assert ctx.storage.size(old_orphan) is None and blob_rows(registry) == set()


def test_the_server_collects_periodically_under_the_lease_and_counts_it(tmp_path):
    settings = Settings(
        home=tmp_path / "home", reaper_interval_s=3600, gc_interval_s=0.2, gc_grace_s=3600, metrics_token="scraper"
    )
    with running_store(settings, "embedded") as live:
        blobs = make_blobs(5, "periodic")
        seed_rows(live, blobs, OLD)
        write_objects(live, blobs)
        deadline = time.monotonic() + 20
        while blob_rows(live) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert blob_rows(live) == set() and stored_digests(live) == set()
        with live.client() as client:
            metrics = client.get("/metrics", headers=live.metrics_headers()).text
    assert 'cgstore_background_rounds_total{outcome="ran",task="gc"}' in metrics
    assert "cgstore_gc_blobs_deleted_total 5.0" in metrics


def test_writes_orphaned_longer_than_the_grace_are_reclaimed(registry):
    """A process that died mid-write left an S3 multipart upload / a directory temp file; a live write is spared."""
    live = registry
    storage = live.context.storage
    digest, young = (blob.digest for blob in make_blobs(2, "orphaned-write"))
    grace_s = GRACE_S
    if isinstance(storage, FileStorage):
        stale = storage.tmp_dir / "dead-writer.tmp"
        stale.write_bytes(b"half a blob")
        two_days_ago = time.time() - 2 * 86400
        os.utime(stale, (two_days_ago, two_days_ago))
        fresh = storage.tmp_dir / "live-writer.tmp"
        fresh.write_bytes(b"being written")
    else:
        # S3 dates an upload by its creation (to the second) and cannot be told otherwise:
        # the grace is seconds here, the dead writer's upload older than it, the live one younger.
        grace_s = 2
        storage.client.create_multipart_upload(Bucket=storage.bucket, Key=storage.blob_key(digest))
        time.sleep(grace_s + 1.5)
        storage.client.create_multipart_upload(Bucket=storage.bucket, Key=storage.blob_key(young))

    def pending() -> list[str]:
        return sorted(u["Key"] for u in storage.client.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", []))

    gc.collect(live.context, dry_run=True, now=NOW, grace_s=grace_s)
    if isinstance(storage, FileStorage):  # a dry run touches nothing
        assert stale.exists()
    else:
        assert len(pending()) == 2
    report = gc.collect(live.context, now=NOW, grace_s=grace_s)
    assert report.sessions_reaped == 1
    if isinstance(storage, FileStorage):
        assert not stale.exists() and fresh.exists()
    else:
        assert pending() == [storage.blob_key(young)]


def test_a_session_commit_of_a_condemned_blob_answers_503_and_keeps_the_session(registry):
    live = registry
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write")
    data = b"bytes GC is deleting"
    digest = "blake3:" + blake3.blake3(data).hexdigest()
    seed_rows(live, [Seeded(digest, data)], OLD)
    assert gc.condemn(live.context, [digest], NOW - dt.timedelta(seconds=GRACE_S), NOW) == [digest]
    with live.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        assert client.patch(location, content=data, headers={"Content-Range": f"0-{len(data) - 1}"}).status_code == 202
        refused = client.put(location, params={"digest": digest})
        assert refused.status_code == 503, refused.text
        gc.collect(live.context, now=NOW, grace_s=GRACE_S)  # GC finishes ...
        committed = client.put(location, params={"digest": digest})  # ... and the same session commits
        assert committed.status_code == 201, committed.text
        assert client.get(f"/v1/repos/acme/{name}/blobs/{digest}", follow_redirects=True).content == data
