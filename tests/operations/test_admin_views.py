"""Admin views on both configurations: ``GET /v1/admin/stats`` and ``cgstore ls/show/stats`` tell the same facts.

The production configuration shares one database between tests, so facts are
checked through what this test adds: its own families, its own publisher,
byte counts as deltas, and the newest audit entries (tests run one at a time).
"""

from __future__ import annotations

import json
import shutil
import uuid
import zipfile

import pytest
from typer.testing import CliRunner

from cgstore.cli import app
from cgstore.operations.scrub import scrub
from cgstore_client.wire.admin import AdminStats, RecordSummary
from cgstore_client.wire.records import Record
from tests.compiled_graphs.support import CONSTANTS_A, publication, publish, safetensors_bytes
from tests.support.live_store import unique_repo
from tests.support.tamper import delete_object


def _component() -> bytes:
    return safetensors_bytes(CONSTANTS_A, metadata={"nonce": uuid.uuid4().hex})


def _cli(store, *args: str):
    env = {
        "CGSTORE_HOME": str(store.settings.home),
        "CGSTORE_DATABASE_URL": store.settings.resolved_database_url,
        "COLUMNS": "250",  # rich folds cells to the terminal width
    }
    return CliRunner().invoke(app, list(args), env=env)


def _stats(store) -> AdminStats:
    admin = store.mint("stats-admin", "*/*:admin")
    with store.client(admin) as client:
        answer = client.get("/v1/admin/stats")
    assert answer.status_code == 200, answer.text
    return AdminStats.model_validate(answer.json())


@pytest.fixture
def scene(store, pt2_archive, pt2_report):
    """Three records in two fresh families by a fresh publisher, a conflict, a denial, one damaged record."""
    before = _stats(store)
    name = unique_repo("admin")
    publisher = f"pub-{uuid.uuid4().hex[:8]}"
    families = [f"fam-{uuid.uuid4().hex[:8]}", f"fam-{uuid.uuid4().hex[:8]}"]
    token = store.mint(publisher, f"acme/{name}:read,write")
    pubs = [
        publication(
            pt2_archive,
            pt2_report,
            components={"consts": _component()},
            family=family,
            envelope={"shapes": [[32, 32]], "text_len": 77, "guidance": [f"{i}.5"]},
        )
        for i, family in enumerate([families[0], families[0], families[1]])
    ]
    with store.client(token) as client:
        for pub in pubs:
            assert publish(client, "acme", name, pub).status_code == 201
        # The same key with other components: a write-once conflict.
        rival = publication(
            pt2_archive,
            pt2_report,
            components={"consts": _component()},
            family=families[0],
            envelope={"shapes": [[32, 32]], "text_len": 77, "guidance": ["0.5"]},
        )
        assert rival.key == pubs[0].key
        assert publish(client, "acme", name, rival).status_code == 409
    outsider = store.mint(f"outsider-{uuid.uuid4().hex[:6]}", f"acme/{unique_repo('other')}:read,write")
    with store.client(outsider) as client:
        assert client.put(pubs[0].path("acme", name), json=pubs[0].manifest).status_code == 403
    delete_object(store, pubs[2].components["consts"].digest)
    assert [f.health for f in scrub(store.context, repo=f"acme/{name}").damaged] == ["missing"]
    store.context.denials.flush()
    return {
        "before": before,
        "repo": f"acme/{name}",
        "publisher": publisher,
        "families": families,
        "pubs": pubs,
        "rival": rival,
    }


def test_stats_endpoint_counts_records_bytes_publishers_conflicts_denials_and_unhealthy(store, scene):
    stats, before, pubs = _stats(store), scene["before"], scene["pubs"]
    sm, lane = pubs[0].manifest["axes"]["sm"], pubs[0].manifest["lane"]
    counts = {(c.family, c.sm, c.lane): c.records for c in stats.records}
    assert counts[(scene["families"][0], sm, lane)] == 2 and counts[(scene["families"][1], sm, lane)] == 1
    assert stats.live_records == before.live_records + 3 == sum(counts.values())

    artifact = pubs[0].artifact.size
    components = [p.components["consts"].size for p in pubs]
    assert stats.storage.logical_bytes - before.storage.logical_bytes == 3 * artifact + sum(components)
    # Four new components stored (the rival's too: uploaded, never published), and the archive if it was new.
    added = stats.storage.stored_bytes - before.storage.stored_bytes
    new_components = sum(components) + scene["rival"].components["consts"].size
    assert added in (new_components, new_components + artifact)
    assert stats.storage.dedup_ratio == round(stats.storage.logical_bytes / stats.storage.referenced_bytes, 3)
    assert stats.storage.dedup_ratio > 1  # one archive stored, bound by three records here

    top = {p.publisher: p.records for p in stats.top_publishers}
    assert top.get(scene["publisher"]) == 3 or (len(top) == 10 and min(top.values()) >= 3)

    conflict = stats.recent_conflicts[0]
    assert conflict.outcome == "KEY_CONFLICT" and conflict.actor == scene["publisher"]
    assert conflict.target.endswith(pubs[0].key)
    assert any(d.outcome == "DENIED" and d.actor.startswith("outsider-") for d in stats.recent_denials)
    unhealthy = stats.unhealthy[0]
    assert (unhealthy.repo, unhealthy.key, unhealthy.health) == (scene["repo"], pubs[2].key, "blob_missing")


def _unique_archive(archive, directory):
    """The same archive under other bytes (a zip comment): an artifact no other record binds."""
    copy = directory / "unique.pt2"
    shutil.copy(archive, copy)
    with zipfile.ZipFile(copy, "a") as zf:
        zf.comment = uuid.uuid4().hex.encode()
    return copy


def test_yanked_records_leave_every_live_count(store, scene, pt2_archive, pt2_report, tmp_path):
    """Yanked records are history: not in the counts, the publishers, the bytes nor ``unhealthy``."""
    pubs, sm, lane = scene["pubs"], scene["pubs"][0].manifest["axes"]["sm"], scene["pubs"][0].manifest["lane"]
    owner, name = scene["repo"].split("/")
    solo = publication(
        _unique_archive(pt2_archive, tmp_path),
        pt2_report,
        components={"consts": _component()},
        family=f"fam-{uuid.uuid4().hex[:8]}",
        envelope={"shapes": [[32, 32]], "text_len": 77},
    )
    with store.client(store.mint(scene["publisher"], f"{scene['repo']}:read,write")) as client:
        assert publish(client, owner, name, solo).status_code == 201
    before = _stats(store)
    yanked = [pubs[2], solo]  # each alone in its family; pubs[2] the damaged one, solo's archive its own
    with store.client(store.mint("stats-admin", "*/*:admin")) as client:
        for pub in yanked:
            answer = client.post(f"{pub.path(owner, name)}:yank", json={"reason": "bad numerics"})
            assert answer.status_code == 200, answer.text
    after = _stats(store)
    counts = {(c.family, c.sm, c.lane): c.records for c in after.records}
    assert not {(scene["families"][1], sm, lane), (solo.manifest["family"], sm, lane)} & set(counts)
    assert counts[(scene["families"][0], sm, lane)] == 2
    assert after.live_records == before.live_records - 2 == sum(counts.values())
    top = {p.publisher: p.records for p in after.top_publishers}
    assert top.get(scene["publisher"]) == 2 or (len(top) == 10 and min(top.values()) >= 2)
    gone = sum(p.artifact.size + p.components["consts"].size for p in yanked)
    assert after.storage.logical_bytes == before.storage.logical_bytes - gone
    # Their components and solo's archive are bound by no live record any more; the shared archive still is.
    unbound = solo.artifact.size + sum(p.components["consts"].size for p in yanked)
    assert after.storage.referenced_bytes == before.storage.referenced_bytes - unbound
    assert after.storage.stored_bytes == before.storage.stored_bytes  # yanking deletes nothing
    assert (scene["repo"], pubs[2].key) not in {(u.repo, u.key) for u in after.unhealthy}


def test_stats_is_admin_only(store):
    with store.client(store.mint("not-admin", "*/*:read,write")) as client:
        denied = client.get("/v1/admin/stats")
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "DENIED"
    with store.client() as client:
        assert client.get("/v1/admin/stats").status_code == 401


def test_cli_stats_tells_the_endpoints_facts(store, scene):
    result = _cli(store, "stats", "--json")
    assert result.exit_code == 0, result.output
    from_cli = AdminStats.model_validate_json(result.output.strip())
    from_http = _stats(store)
    assert from_cli.records == from_http.records and from_cli.storage == from_http.storage
    assert from_cli.unhealthy == from_http.unhealthy and from_cli.top_publishers == from_http.top_publishers
    table = _cli(store, "stats")
    assert table.exit_code == 0, table.output
    for fact in (scene["families"][0], "dedup", "recent conflicts", "KEY_CONFLICT", scene["pubs"][2].key):
        assert fact in table.output


def test_cli_ls_filters_by_family_and_sm(store, scene):
    family, pubs = scene["families"][0], scene["pubs"]
    sm = pubs[0].manifest["axes"]["sm"]
    result = _cli(store, "ls", "--family", family, "--sm", sm, "--json")
    assert result.exit_code == 0, result.output
    rows = [RecordSummary.model_validate_json(line) for line in result.output.splitlines()]
    assert [r.key for r in rows] == [pubs[1].key, pubs[0].key]  # newest first
    assert {r.repo for r in rows} == {scene["repo"]} and {r.publisher for r in rows} == {scene["publisher"]}
    assert _cli(store, "ls", "--family", family, "--sm", "sm_00", "--json").output == ""
    table = _cli(store, "ls", "--family", scene["families"][1])
    assert table.exit_code == 0 and pubs[2].key in table.output and "blob_missing" in table.output
    assert "no matching records" in _cli(store, "ls", "--family", "fam-absent-" + uuid.uuid4().hex[:6]).output


def test_cli_ls_marks_a_private_caches_records(store, pt2_archive, pt2_report):
    name, family = unique_repo("ls-private"), f"fam-{uuid.uuid4().hex[:8]}"
    pub = publication(
        pt2_archive,
        pt2_report,
        components={"consts": _component()},
        family=family,
        envelope={"shapes": [[32, 32]], "text_len": 77},
    )
    with store.client(store.mint("carol", f"acme/{name}:read,write,admin")) as client:
        assert client.put(f"/v1/repos/acme/{name}", json={"visibility": "principal"}).status_code == 201
        assert publish(client, "acme", name, pub).status_code == 201
    listed = _cli(store, "ls", "--family", family, "--json").output.splitlines()
    rows = [RecordSummary.model_validate_json(line) for line in listed]
    assert [(r.key, r.private) for r in rows] == [(pub.key, True)]
    table = _cli(store, "ls", "--family", family)
    assert table.exit_code == 0 and f"acme/{name} (private)" in table.output


def test_cli_ls_piped_prints_plain_columns_never_folded(store, scene):
    """``cgstore ls | …`` (stdout not a terminal) on a narrow terminal: one row per line, tab-separated, whole keys."""
    pubs = scene["pubs"]
    env = {
        "CGSTORE_HOME": str(store.settings.home),
        "CGSTORE_DATABASE_URL": store.settings.resolved_database_url,
        "COLUMNS": "40",
    }
    listed = CliRunner().invoke(app, ["ls", "--family", scene["families"][0]], env=env)
    assert listed.exit_code == 0, listed.output
    header, *rows = listed.output.splitlines()
    assert header.split("\t") == [
        "repo",
        "key",
        "family",
        "sm",
        "lane",
        "health",
        "drift",
        "publisher",
        "created (UTC)",
    ]
    assert [row.split("\t")[1] for row in rows] == [pubs[1].key, pubs[0].key]
    assert all(len(row.split("\t")) == 9 for row in rows)
    stats = CliRunner().invoke(app, ["stats"], env=env).output.splitlines()
    assert "# storage" in stats and "blobs\tstored bytes\treferenced bytes\tlogical bytes\tdedup" in stats


def test_cli_show_prints_the_record(store, scene):
    pub = scene["pubs"][2]
    result = _cli(store, "show", pub.key, "--json")
    assert result.exit_code == 0, result.output
    records = [Record.model_validate(json.loads(line)) for line in result.output.splitlines()]
    mine = [r for r in records if r.repo == scene["repo"]]
    assert len(mine) == 1 and mine[0].health == "blob_missing"
    assert mine[0].manifest.components[0].digest == pub.components["consts"].digest
    table = _cli(store, "show", pub.key)
    assert table.exit_code == 0 and pub.components["consts"].digest in table.output
    absent = _cli(store, "show", "ck1-" + "f" * 56)
    assert absent.exit_code == 1
