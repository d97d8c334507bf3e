"""``cgstore-client`` against the running store: --json on every command, typed failures, the cache commands."""

from __future__ import annotations

import json
import os
import time

import blake3
from cgstore_client.cli import app
from typer.testing import CliRunner

from tests.support.live_store import unique_repo

runner = CliRunner()


def run(store, token, cache, *args):
    return runner.invoke(app, ["--url", store.base_url, "--token", token, "--cache-dir", str(cache), *args])


def test_fetch_verify_ls_prune(store, tmp_path):
    repo = f"acme/{unique_repo()}"
    token = store.mint("worker", f"{repo}:read,write")
    blobs = [os.urandom(200_000 + i) for i in range(2)]
    digests = ["blake3:" + blake3.blake3(b).hexdigest() for b in blobs]
    with store.client(token) as http:
        for data, digest in zip(blobs, digests):
            assert http.put(f"/v1/repos/{repo}/blobs/{digest}", content=data).status_code == 201
    for data, digest in zip(blobs, digests):
        fetched = run(store, token, tmp_path, "fetch", repo, digest, "--size", str(len(data)), "--json")
        assert fetched.exit_code == 0, fetched.output
        assert open(json.loads(fetched.output)["path"], "rb").read() == data
    listed = json.loads(run(store, token, tmp_path, "cache", "ls", "--json").output)
    assert sorted(r["digest"] for r in listed) == sorted(digests)

    rotten = tmp_path / "blobs" / "blake3" / digests[0][7:]
    rotten.write_bytes(b"\0" + blobs[0][1:])
    checked = run(store, token, tmp_path, "verify", "--json")
    assert checked.exit_code == 1
    assert json.loads(checked.output) == {"verified": [digests[1]], "removed": [digests[0]]}

    kept = tmp_path / "blobs" / "blake3" / digests[1][7:]
    os.utime(kept, (time.time() - 3 * 86400, kept.stat().st_mtime))
    assert json.loads(run(store, token, tmp_path, "cache", "prune", "--older-than", "4d", "--json").output) == {"removed": []}
    pruned = json.loads(run(store, token, tmp_path, "cache", "prune", "--older-than", "2d", "--json").output)
    assert pruned == {"removed": [digests[1]]} and not kept.exists()


def test_a_refusal_is_exit_1_with_its_protocol_code(store, tmp_path):
    stranger = store.mint("stranger", f"acme/{unique_repo()}:read")
    refused = run(store, stranger, tmp_path, "fetch", f"acme/{unique_repo()}", "blake3:" + "0" * 64, "--json")
    assert refused.exit_code == 1
    assert json.loads(refused.output)["error"] == {
        "type": "NotFound", "code": "BLOB_UNKNOWN", "message": json.loads(refused.output)["error"]["message"]}
