"""Writes to one store, reads from another: ``Client(write_url=, write_token=)`` / ``CGSTORE_WRITE_URL``.

A worker reading through a regional mirror (which refuses writes) uploads, publishes and claims at
the mirror's upstream. Each store has its own key ring, so a token sent to the wrong store is a 401:
every operation below succeeding proves each token went to its own store, and only there.
"""

from __future__ import annotations

import pytest

from cgstore_client import Client, Denied, Unauthorized
from tests.client.test_boot import derived_key, publish
from tests.support.live_store import unique_repo

pytestmark = pytest.mark.torch


@pytest.fixture
def origin(make_store):
    """The store that takes the writes (the reading store is the session's ``store``, both configurations)."""
    return make_store("embedded")


def test_writes_go_to_the_write_url_and_reads_stay_on_the_url(store, origin, pt2_archive, tmp_path):
    repo = f"acme/{unique_repo()}"
    reader = store.mint("worker", f"{repo}:read")
    writer = origin.mint("mint-child", f"{repo}:read,write", ttl_s=600)
    with Client(store.base_url, reader, cache_dir=tmp_path / "c", write_url=origin.base_url, write_token=writer) as c:
        c.preflight(repo)  # the reading token could not: it may only read, and only on the reading store
        published = publish(c, repo, pt2_archive)
        assert published.status == "created"
        # The record is the origin's, not the reading store's (which a mirror would pull it into).
        (hit,) = c.resolve("tiny-family", [published.key])
        assert hit["status"] == "miss"
    with Client(origin.base_url, writer, cache_dir=tmp_path / "o") as at_origin:
        (hit,) = at_origin.resolve("tiny-family", [derived_key(pt2_archive)])
        assert hit["status"] == "hit" and hit["key"] == published.key


def test_the_environment_names_the_write_store(store, origin, pt2_archive, tmp_path, monkeypatch):
    repo = f"acme/{unique_repo()}"
    token_file = tmp_path / "write-token"
    token_file.write_text(origin.mint("mint-child", f"{repo}:read,write") + "\n")
    monkeypatch.setenv("CGSTORE_URL", store.base_url)
    monkeypatch.setenv("CGSTORE_TOKEN", store.mint("worker", f"{repo}:read"))
    monkeypatch.setenv("CGSTORE_WRITE_URL", origin.base_url + "/")
    monkeypatch.setenv("CGSTORE_WRITE_TOKEN_FILE", str(token_file))
    with Client(cache_dir=tmp_path / "c") as client:
        assert (client.url, client.write_url) == (store.base_url, origin.base_url)
        assert publish(client, repo, pt2_archive).status == "created"


def test_a_write_url_without_its_own_token_never_gets_the_reading_token(store, origin, pt2_archive, tmp_path):
    repo = f"acme/{unique_repo()}"
    reader = store.mint("worker", f"{repo}:read,write")
    with Client(store.base_url, reader, cache_dir=tmp_path, write_url=origin.base_url) as client:
        assert client.write_token is None
        with pytest.raises(Unauthorized):
            client.preflight(repo)
    # Without a write URL, writes go where reads go, with the one token.
    with Client(store.base_url, reader, cache_dir=tmp_path) as client:
        assert client.writer is client.transport
        client.preflight(repo)
        with pytest.raises(Denied):
            client.preflight(repo, min_ttl_s=10**6)
