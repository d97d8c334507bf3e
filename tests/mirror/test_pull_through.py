"""A cold mirror pulls each record and blob from its upstream once, verified, and serves them (issue 27 §1, §2).

The first test runs on the module's cold mirror: the blobs of the session's
archive are not on it yet, so the upstream's tap sees exactly what its pull cost.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import threading

import httpx
from sqlalchemy import select

from cgstore.audit.models import AuditEvent
from cgstore.compiled_graphs.models import CompiledGraph
from cgstore.mirror import service as mirror_service
from cgstore.mirror import trust
from cgstore_client.receipts import proves_root, verify_jws_receipt
from cgstore_client.worker.client import Client
from tests.compiled_graphs.support import digest_of, upload
from tests.mirror.support import MIRROR_FAMILY, OWNER, resolve
from tests.support.live_store import unique_repo

WORKERS = 8


def test_eight_workers_booting_through_a_cold_mirror_cost_the_upstream_each_blob_once(upstream, mirror, tmp_path):
    repo = unique_repo("boot")
    pub = upstream.publish(repo)
    axes = pub.manifest["axes"]
    declaration = {
        "family": MIRROR_FAMILY,
        "envelope": axes["envelope"],
        "sm": axes["sm"],
        "toolchain": axes["toolchain"],
    }
    blobs = {pub.artifact.digest: pub.artifact.size, **{b.digest: b.size for b in pub.components.values()}}
    served_before = {digest: upstream.tap.blob_bytes(digest) for digest in blobs}
    asked_before = {path: upstream.tap.count("POST", path) for path in (":resolve", ":discover")}
    records_before = upstream.tap.count("GET", pub.path(OWNER, repo))
    upstream_keys = upstream.jwks()
    start = threading.Barrier(WORKERS)

    def boot(n: int) -> dict:
        # A worker pinning the upstream's keys: what it verifies, the upstream admitted. Half of them boot
        # by declaration (discover), half by key (resolve): one pull serves both.
        with Client(mirror.base_url, mirror.worker, cache_dir=tmp_path / f"w{n}", trusted_jwks=upstream_keys) as w:
            start.wait(30)
            if n % 2:
                (hit,) = w.resolve(MIRROR_FAMILY, [pub.key])
            else:
                with mirror.live.client(mirror.worker) as client:
                    (hit,) = client.post("/v1/compiled-graphs:discover", json=declaration).json()["candidates"]
            assert hit["status"] == "hit" and hit["key"] == pub.key, hit
            verify_jws_receipt(hit, hit["receipt"], w.jwks())
            for blob in [hit["artifact"], *hit["components"]]:
                assert digest_of(w.fetch_blob(hit["repo"], blob["digest"], blob["size"]).read_bytes()) == blob["digest"]
            return hit

    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        hits = list(pool.map(boot, range(WORKERS)))
    assert {hit["receipt"] for hit in hits} == {hits[0]["receipt"]}
    # The upstream served each blob's bytes exactly once, and the record once; asked at most once per path.
    assert {d: upstream.tap.blob_bytes(d) - served_before[d] for d in blobs} == blobs
    assert upstream.tap.count("GET", pub.path(OWNER, repo)) - records_before == 1
    assert all(upstream.tap.count("POST", path) - before <= 1 for path, before in asked_before.items())
    status = mirror.runtime
    assert status.reachable is True and status.records_pulled >= 1 and status.bytes_pulled >= sum(blobs.values())


def test_the_pulled_record_keeps_the_upstream_receipt_and_origin(upstream, mirror):
    repo = unique_repo("pull")
    pub = upstream.publish(repo)
    with mirror.live.client(mirror.worker) as client:
        since = client.get("/v1/compiled-graphs:events", params={"family": MIRROR_FAMILY}).json()["next"]
        record = client.get(pub.path(OWNER, repo))  # a record GET pulls too
        assert record.status_code == 200, record.text
        hit = resolve(client, pub.key)
    with upstream.live.client(upstream.publisher) as client:
        original = client.get(pub.path(OWNER, repo)).json()
    assert hit["status"] == "hit" and hit["repo"] == f"{OWNER}/{repo}"
    assert hit["receipt"] == original["receipt"] == record.json()["receipt"]
    assert record.json()["manifest"] == original["manifest"]
    assert record.json()["publisher"] == original["publisher"]
    with mirror.live.context.db.session() as session:
        origin = session.scalar(select(CompiledGraph.origin).where(CompiledGraph.key == pub.key))
    assert origin == mirror.live.settings.upstream_url
    with mirror.live.context.db.session() as session:
        pulls = session.scalars(select(AuditEvent).where(AuditEvent.target == f"{OWNER}/{repo}:{pub.key}")).all()
    assert [(a.action, a.actor, a.outcome) for a in pulls] == [("mirror.pull", "mirror", "ok")]
    assert pulls[0].detail["upstream"] == mirror.live.settings.upstream_url
    # The mirror's own feed tells its workers of the pulled record.
    with mirror.live.client(mirror.worker) as client:
        events = client.get("/v1/compiled-graphs:events", params={"family": MIRROR_FAMILY, "since": since}).json()
    assert any(e["key"] == pub.key and e["kind"] == "published" for e in events["events"]), events


def test_discover_pulls_the_records_of_a_declaration(upstream, mirror):
    repo = unique_repo("disc")
    pub = upstream.publish(repo)
    axes = pub.manifest["axes"]
    declaration = {
        "family": MIRROR_FAMILY,
        "envelope": axes["envelope"],
        "sm": axes["sm"],
        "toolchain": axes["toolchain"],
    }
    with mirror.live.client(mirror.worker) as client:
        answer = client.post("/v1/compiled-graphs:discover", json=declaration)
    assert answer.status_code == 200, answer.text
    assert [c["key"] for c in answer.json()["candidates"]] == [pub.key]


def test_a_blob_get_pulls_the_blob(upstream, mirror):
    repo = unique_repo("blob")
    data = b"mirror blob " + repo.encode() * 1000
    blob = type("B", (), {"data": data, "digest": digest_of(data), "size": len(data)})()
    with upstream.live.client(upstream.publisher) as client:
        upload(client, OWNER, repo, blob)
    with mirror.live.client(mirror.worker, follow_redirects=True) as client:
        answer = client.get(f"/v1/repos/{OWNER}/{repo}/blobs/{blob.digest}")
        assert answer.status_code == 200 and answer.content == data
        ranged = client.get(f"/v1/repos/{OWNER}/{repo}/blobs/{blob.digest}", headers={"Range": "bytes=3-9"})
        assert ranged.content == data[3:10]
        absent = client.get(f"/v1/repos/{OWNER}/{repo}/blobs/{digest_of(b'nowhere' + data)}")
        assert absent.status_code == 404 and "upstream" not in absent.json()["error"]["detail"]


def test_an_upstream_miss_is_remembered_briefly(upstream, mirror):
    key = "ck1-" + "7" * 56
    before = upstream.tap.count("POST", "/v1/compiled-graphs:resolve")
    with mirror.live.client(mirror.worker) as client:
        for _ in range(3):
            assert resolve(client, key) == {"key": key, "status": "miss"}
    assert upstream.tap.count("POST", "/v1/compiled-graphs:resolve") - before == 1


def test_an_upstream_yank_applied_to_the_mirror_reaches_its_feed(upstream, mirror):
    repo = unique_repo("yank")
    pub = upstream.publish(repo)
    with mirror.live.client(mirror.worker) as client:
        assert resolve(client, pub.key)["status"] == "hit"
        since = client.get("/v1/compiled-graphs:events", params={"family": MIRROR_FAMILY}).json()["next"]
        upstream.yank(repo, pub.key, "miscompiled")
        # The mirror's follower hears of the yank too and may apply it first: applied once either way.
        mirror_service.apply_yank(mirror.live.context, OWNER, repo, pub.key, "miscompiled")
        assert not mirror_service.apply_yank(mirror.live.context, OWNER, repo, pub.key, "again")
        assert resolve(client, pub.key)["status"] == "miss"  # and not pulled again: the upstream has it yanked too
        events = client.get("/v1/compiled-graphs:events", params={"family": MIRROR_FAMILY, "since": since}).json()
    assert [(e["key"], e["kind"]) for e in events["events"]] == [(pub.key, "yanked")]


def test_a_platform_record_pulled_through_a_mirror_still_proves_root(upstream, mirror, tmp_path):
    repo = unique_repo("models")
    platform = upstream.live.mint("ci", f"root/{repo}:read,write", platform=True)
    pub = upstream.publish(repo, token=platform, owner="root")
    with Client(mirror.base_url, mirror.worker, cache_dir=tmp_path, trusted_jwks=upstream.jwks()) as worker:
        (hit,) = worker.resolve(MIRROR_FAMILY, [pub.key])
        assert hit["status"] == "hit" and hit["repo"] == f"root/{repo}"
        assert proves_root(verify_jws_receipt(hit, hit["receipt"], worker.jwks()))


def test_a_mirror_pulls_nothing_for_a_reader_who_could_not_read_it(upstream, mirror):
    repo = unique_repo("stranger")
    pub = upstream.publish(repo)
    reads = upstream.tap.count("GET", pub.path(OWNER, repo))
    stranger = mirror.live.mint("stranger", "other/*:read")
    with mirror.live.client(stranger) as client:
        assert resolve(client, pub.key)["status"] == "miss"
        assert client.get(pub.path(OWNER, repo)).status_code == 404
    assert upstream.tap.count("GET", pub.path(OWNER, repo)) == reads


def test_a_mirror_pulls_only_the_families_and_architectures_its_filters_want(upstream, make_mirror):
    repo = unique_repo("filt")
    pub = upstream.publish(repo)
    reads = upstream.tap.count("GET", pub.path(OWNER, repo))
    narrow = make_mirror("embedded", mirror_families="flux-*,sdxl")
    with narrow.live.client(narrow.worker) as client:
        assert resolve(client, pub.key)["status"] == "miss"
    assert upstream.tap.count("GET", pub.path(OWNER, repo)) == reads
    globbed = make_mirror("embedded", mirror_families="flux-*, mirror-*", mirror_sm="sm_*,x86*,arm*,cpu*")
    with globbed.live.client(globbed.worker) as client:
        assert resolve(client, pub.key)["status"] == "hit"
    # `cgstore mirror trust --expect`: any other key set is refused, the expected one recorded.
    settings = globbed.live.settings
    env = {
        **os.environ,
        "CGSTORE_HOME": str(settings.home),
        "CGSTORE_UPSTREAM_URL": settings.upstream_url,
        "CGSTORE_UPSTREAM_TOKEN_FILE": str(settings.upstream_token_file),
    }
    cli = [sys.executable, "-m", "cgstore.cli", "mirror"]
    good = trust.fingerprint(upstream.jwks())
    refused = subprocess.run([*cli, "trust", "--expect", "sha256:" + "0" * 64], env=env, capture_output=True, text=True)
    assert refused.returncode == 1 and good in refused.stderr
    trusted = subprocess.run([*cli, "trust", "--expect", good], env=env, capture_output=True, text=True)
    assert trusted.returncode == 0 and trusted.stdout.strip() == good, trusted.stderr
    assert httpx.get(f"{globbed.base_url}/healthz").json()["mirror"]["trusted_fingerprint"] == good
    assert globbed.upstream_token not in refused.stdout + refused.stderr + trusted.stdout + trusted.stderr


def test_concurrent_discovers_of_one_declaration_ask_the_upstream_once(upstream, mirror):
    repo = unique_repo("flight")
    pub = upstream.publish(repo)
    axes = pub.manifest["axes"]
    declaration = {
        "family": MIRROR_FAMILY,
        "envelope": axes["envelope"],
        "sm": axes["sm"],
        "toolchain": axes["toolchain"],
    }
    before = upstream.tap.count("POST", "/v1/compiled-graphs:discover")
    start = threading.Barrier(WORKERS)

    def discover(_: int) -> list[str]:
        with mirror.live.client(mirror.worker) as client:
            start.wait(30)
            answer = client.post("/v1/compiled-graphs:discover", json=declaration)
            assert answer.status_code == 200, answer.text
            return [c["key"] for c in answer.json()["candidates"]]

    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        assert list(pool.map(discover, range(WORKERS))) == [[pub.key]] * WORKERS
    assert upstream.tap.count("POST", "/v1/compiled-graphs:discover") - before == 1


def test_an_interrupted_blob_pull_resumes_from_the_parts_it_has(upstream, tmp_path, monkeypatch):
    from cgstore.mirror import upstream as upstream_client

    monkeypatch.setattr(upstream_client, "PART_BYTES", 4096)
    repo = unique_repo("resume")
    data = bytes(range(256)) * 64 + b"tail"  # 5 parts of 4096 bytes
    blob = type("B", (), {"data": data, "digest": digest_of(data), "size": len(data)})()
    with upstream.live.client(upstream.publisher) as client:
        upload(client, OWNER, repo, blob)
    spool = tmp_path / "spool"
    # A pull cut off after its first two parts: their bytes written, their offsets noted.
    spool.write_bytes(data[:8192] + b"\0" * (len(data) - 8192))
    spool.with_name("spool.parts").write_text("0\n4096\n")
    token = upstream.live.mint("resumer", f"{OWNER}/*:read")
    client = upstream_client.Upstream(upstream.base_url, token, 5.0)
    before = upstream.tap.blob_bytes(blob.digest)
    try:
        assert client.fetch_blob(OWNER, repo, blob.digest, blob.size, spool).read_bytes() == data
    finally:
        client.close()
    assert upstream.tap.blob_bytes(blob.digest) - before == len(data) - 8192  # only the missing parts
    assert not spool.with_name("spool.parts").exists()


def test_a_pull_from_an_upstream_that_redirects_reads_the_parts_from_its_bucket(make_store, tmp_path, monkeypatch):
    from cgstore.mirror import upstream as upstream_client

    monkeypatch.setattr(upstream_client, "PART_BYTES", 4096)
    redirecting = make_store("production")  # S3 with presigned redirects, as an upstream runs by default
    assert redirecting.settings.redirect_downloads
    repo = unique_repo("redirect")
    data = bytes(range(251)) * 50  # 4 parts
    blob = type("B", (), {"data": data, "digest": digest_of(data), "size": len(data)})()
    with redirecting.client(redirecting.mint("publisher", f"{OWNER}/*:read,write")) as client:
        upload(client, OWNER, repo, blob)
    client = upstream_client.Upstream(redirecting.base_url, redirecting.mint("m", f"{OWNER}/*:read"), 5.0)
    try:
        spool = client.fetch_blob(OWNER, repo, blob.digest, blob.size, tmp_path / "spool")
    finally:
        client.close()
    assert spool.read_bytes() == data
