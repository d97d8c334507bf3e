"""The mint child's preflight against the running store: allowed, too short-lived, or not allowed at all."""

from __future__ import annotations

import pytest

from cgstore_client import Client, Denied
from tests.support.live_store import unique_repo


def test_preflight_answers_before_any_compile(store, tmp_path):
    repo = f"acme/{unique_repo()}"
    writer = store.mint("mint-child", f"{repo}:read,write", ttl_s=600)
    with Client(store.base_url, writer, cache_dir=tmp_path) as client:
        client.preflight(repo, min_ttl_s=300)  # 204: go ahead
        with pytest.raises(Denied):
            client.preflight(repo, min_ttl_s=3600)  # the token would expire mid-publish
    reader = store.mint("worker", f"{repo}:read")
    with Client(store.base_url, reader, cache_dir=tmp_path) as client, pytest.raises(Denied) as denied:
        client.preflight(repo)
    assert denied.value.status == 403 and denied.value.code == "DENIED"
