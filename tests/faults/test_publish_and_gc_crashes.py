"""SIGKILL inside a publish and inside a garbage collection: a record is whole or absent, never partial.

Publish points (``compiled_graphs/publishing.py``): ``publish.admitted`` (the
archive was read and admitted, nothing written), ``publish.inserted`` (record,
components and audit written, the transaction not committed) and
``publish.committed`` (committed, the answer not sent). After each the key is
absent or fully published (its event in the feed with it, or neither), the invariant checker finds nothing broken, and a
retry answers 201 (absent) or 200 (it was published). GC point
``gc.condemned``: a batch is condemned and not yet deleted; the next run
finishes it, and the blobs a live record uses are never touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.compiled_graphs.support import CONSTANTS_A, publication, safetensors_bytes, upload_all
from tests.events.support import EVENTS
from tests.faults.conftest import blob_of, unique_bytes
from tests.support.archives import archive_report
from tests.support.services import REPO_ROOT, store_process

pytestmark = [pytest.mark.slow, pytest.mark.torch]


@pytest.fixture(scope="module")
def pub(pt2_archive):
    return publication(pt2_archive, archive_report(pt2_archive), components={"consts": safetensors_bytes(CONSTANTS_A)})


def _client(store, token: str) -> httpx.Client:
    return httpx.Client(base_url=store.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=120)


@pytest.mark.parametrize(
    ("point", "published"),
    [("publish.admitted", False), ("publish.inserted", False), ("publish.committed", True)],
)
def test_killed_inside_a_publish(world, pub, point, published):
    token = world.token("faults-publish", "acme/*:read,write")
    repo = f"pub-{point.replace('.', '-')}"
    with store_process(world.env, world.home) as store, _client(store, token) as client:
        upload_all(client, "acme", repo, pub)
        cursor = client.get(EVENTS, params={"since": "now"}).json()["next"]
    with store_process({**world.env, "CGSTORE_CRASH_AT": point}, world.home) as store, _client(store, token) as client:
        with pytest.raises(httpx.TransportError):
            client.put(pub.path("acme", repo), json=pub.manifest)
        assert store.process.wait(15) == -signal.SIGKILL
    world.assert_invariants()
    with store_process(world.env, world.home) as store, _client(store, token) as client:
        record = client.get(pub.path("acme", repo))
        assert record.status_code == (200 if published else 404), record.text
        if published:
            assert record.json()["manifest"]["artifact"]["digest"] == pub.artifact.digest
        # The record and its event are one fact: the event committed with the record, or neither.
        assert _published_events(client, cursor, repo) == ([pub.key] if published else [])
        retry = client.put(pub.path("acme", repo), json=pub.manifest)
        assert retry.status_code == (200 if published else 201), retry.text
        assert client.get(pub.path("acme", repo)).status_code == 200
        assert _published_events(client, cursor, repo) == [pub.key]
    world.assert_invariants()


def _published_events(client: httpx.Client, cursor: str, repo: str) -> list[str]:
    answer = client.get(EVENTS, params={"since": cursor})
    assert answer.status_code == 200, answer.text
    return [e["key"] for e in answer.json()["events"] if e["kind"] == "published" and e["repo"] == f"acme/{repo}"]


def _gc(world, *extra_env: tuple[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, **world.env, "CGSTORE_HOME": str(world.home), "CGSTORE_LEASE_TTL_S": "2", **dict(extra_env)}
    return subprocess.run(
        [sys.executable, "-m", "cgstore.cli", "gc", "--grace", "0s"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_killed_after_gc_condemned_a_batch(world, pub):
    token = world.token("faults-gc", "acme/*:read,write")
    orphan = unique_bytes("gc-orphan")
    with store_process(world.env, world.home) as store, _client(store, token) as client:
        assert client.put(f"/v1/repos/acme/gc-orphans/blobs/{blob_of(orphan)}", content=orphan).status_code == 201
        upload_all(client, "acme", "gc-kept", pub)
        assert client.put(pub.path("acme", "gc-kept"), json=pub.manifest).status_code in (200, 201)
    killed = _gc(world, ("CGSTORE_CRASH_AT", "gc.condemned"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    world.assert_invariants()
    with store_process(world.env, world.home) as store, _client(store, token) as client:
        # Condemned and not yet deleted: already absent to readers.
        assert client.head(f"/v1/repos/acme/gc-orphans/blobs/{blob_of(orphan)}").status_code == 404
    # The killed collector's lease lapses after its TTL (2 s here); until then another run is refused.
    deadline = time.monotonic() + 30
    while (finished := _gc(world)).returncode != 0 and "holds the gc lease" in finished.stderr:
        assert time.monotonic() < deadline, "the dead collector's lease never lapsed"
        time.sleep(0.5)
    assert finished.returncode == 0, finished.stderr
    assert f"deleted {blob_of(orphan)}" in finished.stdout
    world.assert_invariants()
    with store_process(world.env, world.home) as store, _client(store, token) as client:
        assert client.get(pub.path("acme", "gc-kept")).status_code == 200
        got = client.get(f"/v1/repos/acme/gc-kept/blobs/{pub.artifact.digest}", follow_redirects=False)
        assert got.status_code in (200, 307)
        # The orphan can come back: re-sent, it is stored again.
        assert client.put(f"/v1/repos/acme/gc-orphans/blobs/{blob_of(orphan)}", content=orphan).status_code == 201
    world.assert_invariants()
