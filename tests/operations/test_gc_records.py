"""GC and compiled-graph records: records keep their blobs, and a real publish racing GC never loses."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from sqlalchemy import insert, select

from cgstore.blobs.models import Blob, RepoBlob
from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphComponent
from cgstore.operations import gc
from tests.compiled_graphs.support import CONSTANTS_A, error_code, publication, safetensors_bytes, upload_all
from tests.operations.gc_support import (
    GRACE_S,
    NOW,
    OLD,
    RECENT,
    blob_rows,
    make_blobs,
    make_repo,
    seed_rows,
    write_objects,
)
from tests.support.archives import archive_report
from tests.support.live_store import unique_repo


def seed_record(
    live, repo_id: int, key: str, artifact: str, components: dict[str, str], yanked_at: dt.datetime | None
) -> int:
    """A record row as publish writes it (the columns GC looks at are the real ones)."""
    values = {
        "repo_id": repo_id,
        "key": key,
        "kind": "aot-inductor",
        "format": "pt2",
        "family": "f",
        "lane": "a+b",
        "sm": "sm_90",
        "graph_digest": artifact,
        "envelope": {},
        "envelope_digest": artifact,
        "toolchain": {},
        "toolchain_digest": artifact,
        "recorded_versions": {},
        "artifact_digest": artifact,
        "artifact_size": 1,
        "component_set": artifact,
        "input_contract": {},
        "binding_table": [],
        "publisher": "t",
        "created_at": OLD,
        "yanked_at": yanked_at,
        "health": "ok",
    }
    with live.context.db.session() as session:
        record_id = session.execute(insert(CompiledGraph).values(**values).returning(CompiledGraph.id)).scalar()
        for name, digest in components.items():
            session.add(CompiledGraphComponent(record_id=record_id, name=name, digest=digest, size=1))
        return record_id


def record_ids(live) -> set[int]:
    with live.context.db.session() as session:
        return set(session.scalars(select(CompiledGraph.id)))


def test_live_and_recently_yanked_records_keep_their_blobs_long_yanked_ones_go_with_theirs(registry):
    live = registry
    repo_id = make_repo(live)
    live_art, live_comp, recent_art, recent_comp, old_art, old_comp, shared = make_blobs(7, "records")
    everything = [live_art, live_comp, recent_art, recent_comp, old_art, old_comp, shared]
    seed_rows(live, everything, OLD)  # no young link keeps any of them: only records do
    write_objects(live, everything)
    kept_live = seed_record(
        live, repo_id, "ck1-live", live_art.digest, {"c": live_comp.digest, "s": shared.digest}, None
    )
    kept_recent = seed_record(live, repo_id, "ck1-recent", recent_art.digest, {"c": recent_comp.digest}, RECENT)
    seed_record(live, repo_id, "ck1-old", old_art.digest, {"c": old_comp.digest, "s": shared.digest}, OLD)

    dry = gc.collect(live.context, dry_run=True, now=NOW, grace_s=GRACE_S)
    report = gc.collect(live.context, now=NOW, grace_s=GRACE_S)
    assert sorted(dry.blobs) == sorted(report.blobs) == sorted([old_art.digest, old_comp.digest])
    # The shared component stays (a live record names it); the long-yanked record went with its blobs.
    assert blob_rows(live) == {b.digest for b in everything} - {old_art.digest, old_comp.digest}
    assert record_ids(live) == {kept_live, kept_recent}


# -- a real publish racing GC -------------------------------------------------------------------


@pytest.fixture
def uploaded(registry, pt2_archive):
    """A publication whose blobs were uploaded long ago (so GC may take them) but not published."""
    live = registry
    name = unique_repo()
    token = live.mint("minter", f"acme/{name}:read,write")
    pub = publication(pt2_archive, archive_report(pt2_archive), components={"consts": safetensors_bytes(CONSTANTS_A)})
    with live.client(token) as client:
        upload_all(client, "acme", name, pub)
    digests = [pub.artifact.digest, *(blob.digest for blob in pub.components.values())]
    with live.context.db.session() as session:
        session.execute(Blob.__table__.update().where(Blob.digest.in_(digests)).values(linked_at=OLD))
        session.execute(RepoBlob.__table__.update().where(RepoBlob.digest.in_(digests)).values(created_at=OLD))
    return live, token, name, pub, digests


def cutoff() -> dt.datetime:
    return NOW - dt.timedelta(seconds=GRACE_S)


def test_gc_that_listed_the_blobs_before_a_publish_spares_them_after_it(uploaded):
    live, token, name, pub, digests = uploaded
    listed = [digest for digest, _ in gc.find_candidates(live.context, cutoff(), "", 100)]
    assert sorted(listed) == sorted(digests)  # GC's stale view: all collectable
    with live.client(token) as client:
        assert client.put(pub.path("acme", name), json=pub.manifest).status_code == 201
    assert gc.condemn(live.context, listed, cutoff(), NOW) == []
    assert gc.collect(live.context, now=NOW, grace_s=GRACE_S).blobs == []
    with live.client(token, follow_redirects=True) as client:
        assert client.get(f"/v1/repos/acme/{name}/blobs/{pub.artifact.digest}").content == pub.artifact.data


def test_a_publish_meeting_an_open_condemn_waits_and_is_refused_with_no_record(uploaded):
    live, token, name, pub, digests = uploaded
    answers = []

    def publish() -> None:
        with live.client(token) as client:
            answers.append(client.put(pub.path("acme", name), json=pub.manifest))

    with live.context.db.session() as collection:
        assert gc.condemn_in(collection, digests, cutoff(), NOW) == sorted(digests)
        racer = threading.Thread(target=publish, daemon=True)
        racer.start()
        racer.join(1.0)
        assert racer.is_alive() and answers == []  # held at the blob rows GC is writing
    racer.join(60)
    (answer,) = answers
    assert answer.status_code == 400 and error_code(answer) == "BLOB_UNKNOWN", answer.text
    gc.collect(live.context, now=NOW, grace_s=GRACE_S)
    assert record_ids(live) == set()
    assert all(live.context.storage.size(digest) is None for digest in digests)
    assert blob_rows(live) == set()
