"""Scrub on both configurations: damage done behind the store's back is found, named, and kept from resolve.

Each test publishes real records (archive A plus a component of its own, so the
damaged digests belong to this test alone: the production configuration shares
one database between stores) in a fresh repo, then flips a byte of one stored
blob and deletes another straight in the directory or the bucket.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from cgstore.audit.models import AuditEvent
from cgstore.blobs.models import Blob
from cgstore.cli import app
from cgstore.compiled_graphs.models import CompiledGraph
from cgstore.operations import leases
from cgstore.operations.models import Lease
from cgstore.operations.ratelimit import TokenBucket
from cgstore.operations.scrub import saved_cursor, scrub
from cgstore.repos.models import Repo
from tests.compiled_graphs.support import (
    CONSTANTS_A,
    FAMILY,
    Publication,
    publication,
    publish,
    safetensors_bytes,
    upload,
)
from tests.compiled_graphs.support import (
    Blob as BlobBytes,
)
from tests.support.live_store import CONFIGURATIONS, unique_repo
from tests.support.tamper import delete_object, flip_byte, put_raw, rewrite_s3_object_multipart

MiB = 1 << 20


@dataclass
class World:
    """A repo with three published records, each binding a component of its own."""

    store: object
    repo: str
    token: str
    pubs: list[Publication]

    def component(self, i: int) -> BlobBytes:
        return self.pubs[i].components["consts"]

    def health(self) -> list[str]:
        """This repo's records' health. Every world publishes the same keys (one archive, the same envelopes), so
        a read across repos met other worlds' records, in whatever order the database gave them."""
        owner, name = self.repo.split("/")
        with self.store.context.db.session() as session:
            by_key = dict(
                session.execute(
                    select(CompiledGraph.key, CompiledGraph.health)
                    .join(Repo, Repo.id == CompiledGraph.repo_id)
                    .where(
                        Repo.owner == owner,
                        Repo.name == name,
                        CompiledGraph.key.in_([p.key for p in self.pubs]),
                        CompiledGraph.yanked_at.is_(None),
                    )
                ).all()
            )
        return [by_key[p.key] for p in self.pubs]

    def resolved(self) -> list[bool]:
        with self.store.client(self.token) as client:
            answer = client.post(
                "/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": [p.key for p in self.pubs]}
            )
        assert answer.status_code == 200, answer.text
        return [item["status"] == "hit" for item in answer.json()["answers"]]


@pytest.fixture
def world(store, pt2_archive, pt2_report) -> World:
    name = unique_repo("scrub")
    token = store.mint("scrubbed-minter", f"acme/{name}:read,write")
    pubs = []
    for i in range(3):
        # A nonce in the safetensors metadata: a component digest no other test shares.
        component = safetensors_bytes(CONSTANTS_A, metadata={"nonce": uuid.uuid4().hex})
        pubs.append(
            publication(
                pt2_archive,
                pt2_report,
                components={"consts": component},
                envelope={"shapes": [[64, 64]], "text_len": 77, "guidance": [f"{i}.25"]},
            )
        )
    with store.client(token) as client:
        for pub in pubs:
            assert publish(client, "acme", name, pub).status_code == 201
    return World(store, f"acme/{name}", token, pubs)


def _cli_env(store) -> dict[str, str]:
    return {
        "CGSTORE_HOME": str(store.settings.home),
        "CGSTORE_DATABASE_URL": store.settings.resolved_database_url,
        "CGSTORE_STORAGE_URL": store.settings.resolved_storage_url,
    }  # the S3 keys: this process's AWS_* variables, as for the store in it


def run_cli(store, *args: str):
    return CliRunner().invoke(app, ["scrub", *args], env=_cli_env(store))


# -- finding damage --------------------------------------------------------------------


def test_scrub_names_a_flipped_and_a_deleted_blob_and_resolve_stops_returning_their_records(world):
    store = world.store
    corrupt, missing = world.component(0), world.component(1)
    flip_byte(store, corrupt.digest, corrupt.data)
    delete_object(store, missing.digest)
    assert world.resolved() == [True, True, True]  # nothing checked yet: the store cannot know

    result = run_cli(store, "--repo", world.repo)
    assert result.exit_code == 1, result.output
    assert f"corrupt {corrupt.digest}" in result.output
    assert f"missing {missing.digest}" in result.output
    assert "2 damaged" in result.output and "(complete)" in result.output

    assert world.health() == ["blob_corrupt", "blob_missing", "ok"]
    assert world.resolved() == [False, False, True]
    with store.context.db.session() as session:
        entries = {
            e.target: e.detail
            for e in session.scalars(
                select(AuditEvent).where(
                    AuditEvent.action == "blob.damaged", AuditEvent.target.in_([corrupt.digest, missing.digest])
                )
            )
        }
    assert entries[corrupt.digest]["health"] == "corrupt" and entries[corrupt.digest]["records_changed"] == 1
    assert entries[missing.digest]["health"] == "missing"
    # A damaged blob counts as not held: the pre-upload check asks for it again.
    with store.client(world.token) as client:
        asked = client.post(
            f"/v1/repos/{world.repo}/blobs:missing",
            json={"digests": [corrupt.digest, missing.digest, world.component(2).digest]},
        )
    assert sorted(asked.json()["missing"]) == sorted([corrupt.digest, missing.digest])

    # A second pass finds the same damage again (still exit 1) but changes nothing more.
    again = scrub(store.context, repo=world.repo)
    assert {(f.digest, f.health, f.records_changed) for f in again.damaged} == {
        (corrupt.digest, "corrupt", 0),
        (missing.digest, "missing", 0),
    }

    # Re-uploading the intact bytes heals the blobs and the records.
    with store.client(world.token) as client:
        upload(client, *world.repo.split("/"), corrupt)
        upload(client, *world.repo.split("/"), missing)
    assert world.health() == ["ok", "ok", "ok"]
    assert world.resolved() == [True, True, True]
    healed = run_cli(store, "--repo", world.repo)
    assert healed.exit_code == 0, healed.output
    assert "0 damaged" in healed.output


@pytest.mark.parametrize("store", ["production"], indirect=True)  # an object rewritten through S3 itself
def test_bytes_rewritten_in_s3_by_another_client_are_caught(world):
    """The object of a blob is replaced in the bucket by another S3 client's multipart upload of
    the same size (S3 takes it: a new ETag, the size unchanged); only reading the bytes back shows it."""
    store = world.store
    rewritten = world.component(2)
    damaged = bytearray(rewritten.data)
    damaged[len(damaged) // 2] ^= 0x40
    etag = rewrite_s3_object_multipart(store, rewritten.digest, bytes(damaged))
    assert etag.strip('"').endswith("-1")  # S3 itself wrote it, as one multipart part
    assert store.context.storage.size(rewritten.digest) == len(rewritten.data)

    result = run_cli(store, "--repo", world.repo)
    assert result.exit_code == 1, result.output
    assert f"corrupt {rewritten.digest}" in result.output and "1 damaged" in result.output
    assert world.health() == ["ok", "ok", "blob_corrupt"]
    assert world.resolved() == [True, True, False]


def test_a_record_stays_out_while_any_of_its_blobs_is_damaged(world, pt2_archive, pt2_report):
    """Healing one blob restores only the records whose every blob is intact."""
    store = world.store
    shared = safetensors_bytes(CONSTANTS_A, metadata={"nonce": uuid.uuid4().hex})
    name = world.repo.split("/")[1]
    # Two records sharing one component: damaging it takes both out.
    pubs = [
        publication(
            pt2_archive,
            pt2_report,
            components={"consts": shared},
            envelope={"shapes": [[8, 8]], "text_len": 77, "guidance": [f"{i}.75"]},
        )
        for i in range(2)
    ]
    with store.client(world.token) as client:
        for pub in pubs:
            assert publish(client, "acme", name, pub).status_code == 201
    world.pubs.extend(pubs)
    component = pubs[0].components["consts"]
    delete_object(store, component.digest)
    report = scrub(store.context, repo=world.repo)
    assert [(f.digest, f.records_changed) for f in report.damaged] == [(component.digest, 2)]
    assert world.health()[3:] == ["blob_missing", "blob_missing"]

    # The bytes come back behind the store's back: the next scrub finds them intact and heals.
    put_raw(store, component.digest, component.data)
    report = scrub(store.context, repo=world.repo)
    assert report.damaged == [] and [(f.digest, f.records_changed) for f in report.healed] == [(component.digest, 2)]
    assert world.resolved() == [True] * 5
    result = run_cli(store, "--repo", world.repo)
    assert result.exit_code == 0 and "0 healed" in result.output  # nothing left to heal


# -- sampling, pacing, resuming --------------------------------------------------------


def _repo_blobs(world) -> int:
    return 1 + len(world.pubs)  # the shared artifact plus one component per record


def test_sample_checks_that_many_blobs_and_leaves_the_cursor(world):
    store = world.store
    delete_object(store, world.component(2).digest)
    total = _repo_blobs(world)
    report = scrub(store.context, repo=world.repo, sample=2)
    assert report.checked == 2 and not report.complete
    assert saved_cursor(store.context, world.repo) is None
    found = set()
    for _ in range(20):  # random picks: the deleted one turns up soon
        found |= {f.digest for f in scrub(store.context, repo=world.repo, sample=2).damaged}
        if found:
            break
    assert found == {world.component(2).digest}
    everything = run_cli(store, "--repo", world.repo, "--sample", str(total + 10))
    assert everything.exit_code == 1 and f"{total} blobs checked" in everything.output
    assert run_cli(store, "--repo", world.repo, "--sample", "1", "--resume").exit_code == 2
    with store.client(world.token) as client:
        upload(client, *world.repo.split("/"), world.component(2))
    assert world.resolved() == [True, True, True]


def test_an_interrupted_pass_resumes_at_its_cursor(world):
    store = world.store
    total = _repo_blobs(world)
    blobs = {world.pubs[0].artifact.digest: world.pubs[0].artifact.data}
    blobs.update({world.component(i).digest: world.component(i).data for i in range(3)})
    ordered = sorted(blobs)  # a pass walks in digest order
    # The last blob in digest order is damaged: the interrupted pass has not reached it.
    last, data = ordered[-1], blobs[ordered[-1]]
    flip_byte(store, last, data, at=0)

    calls = []

    def heartbeat():  # a lease lost before the third blob
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("lease lost")

    with pytest.raises(RuntimeError):
        scrub(store.context, repo=world.repo, heartbeat=heartbeat)
    assert saved_cursor(store.context, world.repo) == ordered[1]

    result = run_cli(store, "--repo", world.repo, "--resume")
    assert result.exit_code == 1, result.output
    assert f"{total - 2} blobs checked" in result.output and f"corrupt {last}" in result.output
    assert saved_cursor(store.context, world.repo) is None  # the pass completed
    # Without --resume a pass starts from the beginning.
    assert scrub(store.context, repo=world.repo).checked == total
    put_raw(store, last, data)
    assert scrub(store.context, repo=world.repo).damaged == []


def test_rate_limits_the_bytes_read(world):
    store = world.store
    started = time.monotonic()
    report = scrub(store.context, repo=world.repo, rate_bytes_s=0.5 * MiB)
    elapsed = time.monotonic() - started
    assert report.bytes_read > 1.4 * MiB  # the 1.5 MiB archive and three small components
    # One second's burst is free; the rest is paid for at the rate.
    assert elapsed >= (report.bytes_read - 0.5 * MiB) / (0.5 * MiB) * 0.95


def test_token_bucket_sleeps_exactly_the_debt():
    now = [0.0]
    slept = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    bucket = TokenBucket(100.0, 100.0, clock=lambda: now[0], sleep=sleep)
    bucket.take(100)  # the initial burst
    assert slept == []
    bucket.take(50)  # no time passed: half a second of debt
    assert slept == [pytest.approx(0.5)]
    now[0] += 10  # idle: refills to the burst, not beyond
    bucket.take(150)
    assert slept[-1] == pytest.approx(0.5)


def test_unknown_repo_is_an_error_not_damage(store):
    result = run_cli(store, "--repo", f"acme/{unique_repo('nowhere')}")
    assert result.exit_code == 2 and "NAME_UNKNOWN" in result.output


def test_a_damaged_blob_is_not_held_until_sent_again_through_a_session(world, pt2_archive, pt2_report):
    """Publishing over a damaged blob is refused; a mount does not heal it; a resumable upload does."""
    store = world.store
    owner, name = world.repo.split("/")
    damaged = world.component(0)
    flip_byte(store, damaged.digest, damaged.data, at=0)
    assert [f.digest for f in scrub(store.context, repo=world.repo).damaged] == [damaged.digest]
    again = publication(
        pt2_archive,
        pt2_report,
        components={"consts": damaged.data},
        envelope={"shapes": [[16, 16]], "text_len": 77, "guidance": ["9.5"]},
    )
    with store.client(world.token) as client:
        refused = client.put(again.path(owner, name), json=again.manifest)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "BLOB_UNKNOWN"
        assert refused.json()["error"]["detail"]["missing"] == [damaged.digest]
    # A mount into another repo links the blob but writes no bytes: still damaged.
    other = unique_repo("scrub-mount")
    both = store.mint("scrubbed-minter", f"acme/{other}:read,write", f"acme/{name}:read,write")
    with store.client(both) as client:
        mounted = client.post(f"/v1/repos/acme/{other}/blobs/{damaged.digest}:mount", params={"from": world.repo})
        assert mounted.status_code == 201, mounted.text
    assert world.health()[0] == "blob_corrupt"
    # The exact bytes through a resumable session: rewritten, verified, healed.
    with store.client(world.token) as client:
        location = client.post(f"/v1/repos/{world.repo}/uploads").headers["location"]
        assert client.put(location, params={"digest": damaged.digest}, content=damaged.data).status_code == 201
        assert client.put(again.path(owner, name), json=again.manifest).status_code == 201
    assert world.health() == ["ok", "ok", "ok"]
    with store.context.db.session() as session:
        healed = session.scalar(
            select(AuditEvent).where(AuditEvent.action == "blob.healed", AuditEvent.target == damaged.digest)
        )
    assert healed.actor == "scrubbed-minter" and healed.detail["was"] == "corrupt"
    assert scrub(store.context, repo=world.repo).damaged == []


def test_one_scrub_at_a_time_under_the_scrub_lease(world):
    """Refused (exit 2) while another replica holds the lease; runs once it lapses, and lets it go after."""
    store = world.store
    busy = leases.acquire(store.context.db, leases.SCRUB, "busy-replica", ttl_s=600)
    assert busy is not None
    try:
        refused = run_cli(store, "--repo", world.repo)
        assert refused.exit_code == 2 and "holds the scrub lease" in refused.output
    finally:
        busy.release()
    ran = run_cli(store, "--repo", world.repo)
    assert ran.exit_code == 0, ran.output
    # Released after the run: another replica takes it at once.
    assert leases.acquire(store.context.db, leases.SCRUB, "next-replica", ttl_s=600) is not None
    leases.release(store.context.db, "next-replica")


# -- the server's periodic scrub ---------------------------------------------------------


def _health(live, digest: str) -> str:
    with live.context.db.session() as session:
        return session.get(Blob, digest).health


def _flipped_blob(live) -> BlobBytes:
    """A blob uploaded to a fresh repo, then one of its stored bits flipped behind the store's back."""
    name = unique_repo("periodic-scrub")
    blob = BlobBytes(b"bytes the periodic scrub must find damaged " + uuid.uuid4().bytes)
    with live.client(live.mint("uploader", f"acme/{name}:read,write")) as client:
        upload(client, "acme", name, blob)
    flip_byte(live, blob.digest, blob.data)
    return blob


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_the_server_scrubs_every_interval_under_its_lease_and_marks_damage_no_one_asked_about(
    make_registry, configuration
):
    # A registry of its own: the scrub reads every blob row, and the session database
    # names other stores' blobs, whose bytes are in other buckets.
    live = make_registry(configuration, scrub_interval_s=0.2)
    blob = _flipped_blob(live)
    deadline = time.monotonic() + 30
    while _health(live, blob.digest) != "corrupt":
        assert time.monotonic() < deadline, "the periodic scrub never marked the flipped blob"
        time.sleep(0.1)
    with live.context.db.session() as session:
        assert session.get(Lease, leases.SCRUB).holder == live.context.instance
    assert 'cgstore_background_rounds_total{outcome="ran",task="scrub"}' in live.scrape_metrics()


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_with_the_interval_at_zero_the_server_never_scrubs(make_registry, configuration):
    live = make_registry(configuration)  # CGSTORE_SCRUB_INTERVAL_S defaults to 0: off
    assert live.settings.scrub_interval_s == 0
    blob = _flipped_blob(live)
    time.sleep(1.5)
    assert _health(live, blob.digest) == "ok"
    with live.context.db.session() as session:
        assert session.get(Lease, leases.SCRUB) is None
    assert 'task="scrub"' not in live.scrape_metrics()


def test_a_limited_walk_stops_with_its_cursor_saved_and_the_next_one_resumes_there(world):
    """The bound of a periodic round: ``limit`` blobs, then the next round carries on."""
    store = world.store
    first = scrub(store.context, repo=world.repo, limit=2)
    assert first.checked == 2 and not first.complete
    cursor = saved_cursor(store.context, world.repo)
    assert cursor is not None
    rest = scrub(store.context, repo=world.repo, resume=True, limit=1000)
    assert rest.complete and rest.checked >= 1
    assert saved_cursor(store.context, world.repo) is None
