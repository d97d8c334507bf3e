"""Write-once under races, and publishes cut off from the database or S3: never a half-written record."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphComponent
from cgstore.repos.models import Repo
from tests.compiled_graphs.support import (
    CONSTANTS_A,
    error_code,
    publication,
    publish,
    safetensors_bytes,
    upload_all,
)
from tests.hostile.corpus import rewrite
from tests.support.archives import archive_report
from tests.support.live_store import unique_repo
from tests.support.proxy import CuttableProxy
from tests.support.services import use_s3_credentials

RACERS = 8
#: Cuts spread evenly over one publish's duration.
CUTS = 6


def rows_for(live, repo: str, key: str) -> tuple[int, int]:
    """(live records, their components) for ``key`` in ``acme/<repo>``."""
    with live.context.db.session() as session:
        ids = session.scalars(
            select(CompiledGraph.id)
            .join(Repo, Repo.id == CompiledGraph.repo_id)
            .where(Repo.owner == "acme", Repo.name == repo, CompiledGraph.key == key, CompiledGraph.yanked_at.is_(None))
        ).all()
        components = session.scalar(
            select(func.count()).select_from(CompiledGraphComponent).where(CompiledGraphComponent.record_id.in_(ids))
        )
    return len(ids), components


def race(live, token: str, name: str, pubs) -> list[int]:
    """PUT every publication's manifest at once (blobs already uploaded); the status codes."""
    barrier = threading.Barrier(len(pubs))

    def put(pub) -> int:
        with live.client(token) as client:
            barrier.wait()
            return client.put(pub.path("acme", name), json=pub.manifest).status_code

    with ThreadPoolExecutor(len(pubs)) as pool:
        return sorted(pool.map(put, pubs))


def test_simultaneous_identical_publishes_one_201_seven_200(store, pt2_archive, report_a, constants_a):
    name = unique_repo()
    token = store.mint("minter", f"acme/{name}:read,write")
    pub = publication(pt2_archive, report_a, components={"consts": constants_a})
    with store.client(token) as client:
        upload_all(client, "acme", name, pub)
    assert race(store, token, name, [pub] * RACERS) == [200] * (RACERS - 1) + [201]
    assert rows_for(store, name, pub.key) == (1, 1)


def test_simultaneous_different_artifacts_one_201_seven_409(store, pt2_archive, report_a, constants_a, tmp_path):
    name = unique_repo()
    token = store.mint("minter", f"acme/{name}:read,write")
    # Eight artifacts of one program (one key), each repackaged with its own extra entry.
    pubs = []
    for i in range(RACERS):
        variant = rewrite(pt2_archive, tmp_path / f"v{i}.pt2", add=[(f"archive/extra/mint-{i}.txt", b"%d" % i)])
        pubs.append(publication(variant, archive_report(variant), components={"consts": constants_a}))
    assert len({pub.key for pub in pubs}) == 1 and len({pub.artifact.digest for pub in pubs}) == RACERS
    with store.client(token) as client:
        for pub in pubs:
            upload_all(client, "acme", name, pub)
    assert race(store, token, name, pubs) == [201] + [409] * (RACERS - 1)
    assert rows_for(store, name, pubs[0].key) == (1, 1)


# -- outages ---------------------------------------------------------------------------------


@pytest.fixture
def cut_store(make_store, pg_url, s3_server):
    """A store reaching PostgreSQL and S3 through cuttable proxies: ``(live, db_proxy, s3_proxy)``."""
    use_s3_credentials(s3_server)
    db_proxy = CuttableProxy(5432)
    s3_proxy = CuttableProxy(int(s3_server.endpoint_url.rsplit(":", 1)[1]))
    try:
        live = make_store(
            "embedded",
            database_url=pg_url.replace(":5432/", f":{db_proxy.port}/"),
            storage_url=f"s3://{s3_server.create_bucket()}?endpoint_url=http://127.0.0.1:{s3_proxy.port}&region=us-east-1",
        )
        yield live, db_proxy, s3_proxy
    finally:
        db_proxy.close()
        s3_proxy.close()


def fresh_publication(tmp_path: Path, pt2_archive: Path):
    """Archive A with bytes no other store has seen (stores of this module share one database
    but not one bucket, and blobs are stored once by digest)."""
    tag = uuid.uuid4().hex
    variant = rewrite(pt2_archive, tmp_path / f"{tag}.pt2", add=[(f"archive/extra/{tag}.txt", tag.encode())])
    return publication(
        variant, archive_report(variant), components={"consts": safetensors_bytes(CONSTANTS_A, {"tag": tag})}
    )


def until_ready(client: httpx.Client, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, "the store did not recover"
        time.sleep(0.1)


def fully_published_or_absent(client: httpx.Client, live, name: str, pub) -> bool:
    """The record is complete (resolvable, components and bytes there) or absent; True when published."""
    got = client.get(pub.path("acme", name))
    rows = rows_for(live, name, pub.key)
    if got.status_code == 404:
        assert rows == (0, 0)
        return False
    assert got.status_code == 200, got.text
    assert rows == (1, 1)
    assert live.context.storage.size(pub.artifact.digest) == pub.artifact.size
    hit = client.post("/v1/compiled-graphs:resolve", json={"family": pub.manifest["family"], "keys": [pub.key]})
    assert hit.json()["answers"][0]["status"] == "hit"
    return True


@pytest.mark.parametrize("service", ["database", "s3"])
def test_cut_between_upload_and_publish_then_retry(cut_store, pt2_archive, tmp_path, service):
    live, db_proxy, s3_proxy = cut_store
    proxy = db_proxy if service == "database" else s3_proxy
    name = unique_repo()
    token = live.mint("minter", f"acme/{name}:read,write")
    pub = fresh_publication(tmp_path, pt2_archive)
    with live.client(token) as client:
        upload_all(client, "acme", name, pub)
        proxy.cut()
        try:
            cut_off = client.put(pub.path("acme", name), json=pub.manifest)
        finally:
            proxy.restore()
        assert cut_off.status_code == 503 and error_code(cut_off) == "UNAVAILABLE"
        assert cut_off.headers["retry-after"]
        until_ready(client)
        assert not fully_published_or_absent(client, live, name, pub)
        retry = client.put(pub.path("acme", name), json=pub.manifest)
        assert retry.status_code == 201, retry.text
        assert fully_published_or_absent(client, live, name, pub)


@pytest.mark.parametrize("service", ["database", "s3"])
def test_cut_in_the_middle_of_a_publish_leaves_it_whole_or_absent(cut_store, pt2_archive, tmp_path, service):
    live, db_proxy, s3_proxy = cut_store
    proxy = db_proxy if service == "database" else s3_proxy
    # How long one publish takes here, to spread the cuts over it.
    name = unique_repo()
    token = live.mint("minter", f"acme/{name}:read,write")
    with live.client(token) as client:
        probe = fresh_publication(tmp_path, pt2_archive)
        started = time.monotonic()
        assert publish(client, "acme", name, probe).status_code == 201
        duration = time.monotonic() - started
    outcomes = []
    for step in range(CUTS):
        name = unique_repo()
        token = live.mint("minter", f"acme/{name}:read,write")
        pub = fresh_publication(tmp_path, pt2_archive)
        with live.client(token) as client:
            upload_all(client, "acme", name, pub)
            answer: dict[str, httpx.Response] = {}
            put = threading.Thread(
                target=lambda: answer.setdefault("r", client.put(pub.path("acme", name), json=pub.manifest))
            )
            put.start()
            time.sleep(duration * step / CUTS)
            proxy.cut()
            put.join(60)
            proxy.restore()
            assert answer["r"].status_code in (201, 503), answer["r"].text
            outcomes.append(answer["r"].status_code)
            until_ready(client)
            was_published = fully_published_or_absent(client, live, name, pub)
            assert was_published or answer["r"].status_code == 503
            retry = client.put(pub.path("acme", name), json=pub.manifest)
            assert retry.status_code == (200 if was_published else 201), retry.text
            assert fully_published_or_absent(client, live, name, pub)
    print(f"cut {service} at {[round(duration * step / CUTS, 3) for step in range(CUTS)]} s: {outcomes}")
    assert 503 in outcomes  # the early cuts did cut a publish off
