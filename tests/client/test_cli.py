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
        for data, digest in zip(blobs, digests, strict=True):
            assert http.put(f"/v1/repos/{repo}/blobs/{digest}", content=data).status_code == 201
    for data, digest in zip(blobs, digests, strict=True):
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


def test_publish_resolve_load_preflight(store, pt2_archive, tmp_path):
    import shutil

    from cgstore_client.archive import inspect
    from cgstore_client.mint import derived_constants_path

    archive = tmp_path / "model.pt2"
    shutil.copy(pt2_archive, archive)
    shutil.copy(derived_constants_path(pt2_archive), derived_constants_path(archive))
    repo = f"acme/{unique_repo()}"
    token = store.mint("mint-child", f"{repo}:read,write")
    assert json.loads(run(store, token, tmp_path / "c", "preflight", repo, "--json").output) == {"repo": repo, "ok": True}
    args = ["--family", "cli-family", "--envelope", '{"shapes": [[64, 64]], "text_len": 0}',
            "--sm", inspect(archive).sm, "--toolchain", '{"torch": "2.13.0"}', "--json"]
    published = json.loads(run(store, token, tmp_path / "c", "publish", repo, str(archive), *args).output)
    assert published["status"] == "created"
    key = published["key"]
    assert json.loads(run(store, token, tmp_path / "c", "publish", repo, str(archive), *args).output)["status"] == "exists"
    (answer,) = json.loads(run(store, token, tmp_path / "c", "resolve", "cli-family", key, "--json").output)
    assert (answer["key"], answer["status"], answer["repo"]) == (key, "hit", repo)
    (loaded,) = json.loads(run(store, token, tmp_path / "w", "load", "cli-family", key, "--mandatory", key, "--json").output)
    assert loaded["status"] == "loaded" and open(loaded["artifact"], "rb").read() == archive.read_bytes()
    missing = run(store, token, tmp_path / "w", "load", "cli-family", "ck1-" + "e" * 56, "--mandatory", "ck1-" + "e" * 56, "--json")
    assert missing.exit_code == 1 and json.loads(missing.output)["error"]["type"] == "CompiledRequired"
