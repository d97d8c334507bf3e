"""``cgstore-client`` against the running store: --json on every command, typed failures, the cache commands."""

from __future__ import annotations

import json
import os
import time

import blake3
from typer.testing import CliRunner

from cgstore_client.worker.cli import app
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
    assert json.loads(run(store, token, tmp_path, "cache", "prune", "--older-than", "4d", "--json").output) == {
        "removed": []
    }
    pruned = json.loads(run(store, token, tmp_path, "cache", "prune", "--older-than", "2d", "--json").output)
    assert pruned == {"removed": [digests[1]]} and not kept.exists()


def test_a_refusal_is_exit_1_with_its_protocol_code(store, tmp_path):
    stranger = store.mint("stranger", f"acme/{unique_repo()}:read")
    refused = run(store, stranger, tmp_path, "fetch", f"acme/{unique_repo()}", "blake3:" + "0" * 64, "--json")
    assert refused.exit_code == 1
    assert json.loads(refused.output)["error"] == {
        "type": "NotFound",
        "code": "BLOB_UNKNOWN",
        "message": json.loads(refused.output)["error"]["message"],
    }


def test_publish_resolve_load_preflight(store, pt2_archive, tmp_path):
    import shutil

    from cgstore_client.archive import inspect
    from cgstore_client.mint import derived_constants_path

    archive = tmp_path / "model.pt2"
    shutil.copy(pt2_archive, archive)
    shutil.copy(derived_constants_path(pt2_archive), derived_constants_path(archive))
    repo = f"acme/{unique_repo()}"
    token = store.mint("mint-child", f"{repo}:read,write")
    assert json.loads(run(store, token, tmp_path / "c", "preflight", repo, "--json").output) == {
        "repo": repo,
        "ok": True,
    }
    args = [
        "--family",
        "cli-family",
        "--envelope",
        '{"shapes": [[64, 64]], "text_len": 0}',
        "--sm",
        inspect(archive).sm,
        "--toolchain",
        '{"torch": "2.13.0"}',
        "--json",
    ]
    published = json.loads(run(store, token, tmp_path / "c", "publish", repo, str(archive), *args).output)
    assert published["status"] == "created"
    key = published["key"]
    assert (
        json.loads(run(store, token, tmp_path / "c", "publish", repo, str(archive), *args).output)["status"] == "exists"
    )
    (answer,) = json.loads(run(store, token, tmp_path / "c", "resolve", "cli-family", key, "--json").output)
    assert (answer["key"], answer["status"], answer["repo"]) == (key, "hit", repo)
    (loaded,) = json.loads(
        run(store, token, tmp_path / "w", "load", "cli-family", key, "--mandatory", key, "--json").output
    )
    assert loaded["status"] == "loaded" and open(loaded["artifact"], "rb").read() == archive.read_bytes()
    missing = run(
        store,
        token,
        tmp_path / "w",
        "load",
        "cli-family",
        "ck1-" + "e" * 56,
        "--mandatory",
        "ck1-" + "e" * 56,
        "--json",
    )
    assert missing.exit_code == 1 and json.loads(missing.output)["error"]["type"] == "CompiledRequired"


def test_publish_reads_the_sm_from_the_archive_and_discover_explains_a_miss(store, pt2_archive, tmp_path):
    """No --sm (the archive states it), --release and --code; discover finds it; --explain names the axis."""
    import shutil
    import uuid

    from cgstore_client.archive import inspect
    from cgstore_client.mint import derived_constants_path

    archive = tmp_path / "model.pt2"
    shutil.copy(pt2_archive, archive)
    shutil.copy(derived_constants_path(pt2_archive), derived_constants_path(archive))
    repo, family, code = f"acme/{unique_repo()}", f"cli-{uuid.uuid4().hex[:8]}", "cf1:" + "c" * 64
    token = store.mint("mint-child", f"{repo}:read,write")
    envelope, toolchain = '{"shapes": [[64, 64]], "text_len": 0}', '{"torch": "2.13.0"}'
    published = run(
        store,
        token,
        tmp_path / "c",
        "publish",
        repo,
        str(archive),
        "--family",
        family,
        "--envelope",
        envelope,
        "--toolchain",
        toolchain,
        "--release",
        "endpoint-7",
        "--code",
        code,
        "--json",
    )
    assert published.exit_code == 0, published.output
    key = json.loads(published.output)["key"]
    declared = ["discover", family, "--envelope", envelope, "--sm", inspect(archive).sm, "--toolchain", toolchain]
    found = json.loads(
        run(store, token, tmp_path / "c", *declared, "--release", "endpoint-7", "--code", code, "--json").output
    )
    assert [(c["key"], c["repo"], c["release"]) for c in found["candidates"]] == [(key, repo, "endpoint-7")]
    missed = run(store, token, tmp_path / "c", *declared, "--release", "endpoint-8", "--explain")
    assert missed.exit_code == 1
    assert missed.output.strip() == (
        f"miss: 1 record of {family} in {repo}; nearest differs in release: endpoint-8 here, endpoint-7 recorded"
    )


def test_inspect_prints_the_key_sm_contract_and_binding_table(pt2_archive, tmp_path):
    from cgstore_client.archive import inspect
    from cgstore_client.keys import Envelope, Toolchain, ck1

    report = inspect(pt2_archive)
    envelope = {"shapes": [[64, 64]], "text_len": 0}
    shown = runner.invoke(
        app,
        [
            "inspect",
            str(pt2_archive),
            "--envelope",
            json.dumps(envelope),
            "--toolchain",
            '{"torch": "2.13.0"}',
            "--json",
        ],
    )
    assert shown.exit_code == 0, shown.output
    document = json.loads(shown.output)
    assert document["key"] == ck1(
        report.graph_digest, Envelope.from_dict(envelope), report.sm, Toolchain({"torch": "2.13.0"})
    )
    assert (document["sm"], document["input_contract"]) == (report.sm, report.input_contract)
    assert [row["fqn"] for row in document["binding_table"]] == [row["fqn"] for row in report.binding_table]
    text = runner.invoke(app, ["inspect", str(pt2_archive)]).output
    assert f"sm         {report.sm}" in text and report.binding_table[0]["fqn"] in text


def test_a_store_down_is_a_clean_unavailable_line(tmp_path):
    from tests.support.services import free_port

    down = runner.invoke(
        app,
        [
            "--url",
            f"http://127.0.0.1:{free_port()}",
            "--token",
            "t",
            "--cache-dir",
            str(tmp_path),
            "preflight",
            "acme/models",
        ],
    )
    assert down.exit_code == 1
    assert down.output.startswith("error: unavailable: POST /v1/repos/acme/models/preflight: ConnectError")
