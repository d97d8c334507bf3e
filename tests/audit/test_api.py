"""``GET /v1/audit``: admins only, filters, keyset pages (both configurations)."""

from __future__ import annotations

import datetime as dt

import blake3
import pytest

from cgstore.audit.models import AuditEvent
from cgstore_client.wire.audit import AuditPage
from tests.audit.conftest import rows
from tests.compiled_graphs.support import CONSTANTS_A, publication, publish, safetensors_bytes, unique_envelope
from tests.support.archives import archive_report
from tests.support.live_store import unique_repo


def _blob(tag: str) -> tuple[bytes, str]:
    data = f"audit api {tag}".encode()
    return data, "blake3:" + blake3.blake3(data).hexdigest()


def _page(client, **params) -> AuditPage:
    answer = client.get("/v1/audit", params=params)
    assert answer.status_code == 200, answer.text
    return AuditPage.model_validate(answer.json())


@pytest.fixture
def activity(store):
    """In a fresh repo: an upload and a mount by alice, three refused writes by mallory."""
    name, other = unique_repo("api"), unique_repo("api-src")
    alice = store.mint("alice", f"acme/{name}:read,write", f"acme/{other}:read,write")
    data, digest = _blob(name)
    with store.client(alice) as client:
        assert client.put(f"/v1/repos/acme/{other}/blobs/{digest}", content=data).status_code == 201
        assert (
            client.post(f"/v1/repos/acme/{name}/blobs/{digest}:mount", params={"from": f"acme/{other}"}).status_code
            == 201
        )
    with store.client(store.mint("mallory", "acme/nothing:read")) as client:
        for _ in range(3):
            assert client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data).status_code == 403
    return name, other, digest


def test_non_admins_are_denied_and_audited(store):
    for grants in (["acme/*:read,write"], ["acme/*:admin"]):  # an owner-scoped admin is not the registry's
        token = store.mint("nosy", *grants)
        with store.client(token) as client:
            answer = client.get("/v1/audit")
        assert answer.status_code == 403 and answer.json()["error"]["code"] == "DENIED"
    denied = rows(store, AuditEvent.actor == "nosy", AuditEvent.action == "GET /v1/audit")
    assert [row.outcome for row in denied][-2:] == ["DENIED", "DENIED"]
    with store.client() as client:
        assert client.get("/v1/audit").status_code == 401


def test_filters(store, admin, activity):
    name, other, digest = activity
    with store.client(admin) as client:
        everything = _page(client, repo=f"acme/{name}").entries
        assert [(e.actor, e.action, e.outcome) for e in everything] == [
            ("alice", "repo.create", "ok"),  # the mount's first write created it
            ("alice", "blob.mount", "ok"),
            *[("mallory", "PUT /v1/repos/{owner}/{repo}/blobs/{digest}", "DENIED")] * 3,
        ]
        mount = everything[1]
        assert mount.target == f"acme/{name}@{digest}" and mount.detail["source"] == f"acme/{other}"
        assert mount.jti and everything[-1].source == "127.0.0.1" and all(e.count == 1 for e in everything)
        assert [e.outcome for e in _page(client, repo=f"acme/{name}", outcome="DENIED").entries] == ["DENIED"] * 3
        assert [e.action for e in _page(client, repo=f"acme/{other}", actor="alice").entries] == [
            "repo.create",
            "blob.upload",
        ]
        assert _page(client, repo=f"acme/{name}", actor="alice", action="blob.*").entries == [mount]
        assert _page(client, repo=f"acme/{name}", action="blob.upload").entries == []
        assert _page(client, repo=f"acme/{name}", jti=mount.jti).entries == everything[:2]
        assert _page(client, target=f"acme/{name}@*").entries == [mount]
        assert _page(client, target=f"acme/{name}@{digest}").entries == [mount]
        assert _page(client, target=f"acme/{name}@").entries == []  # exact unless it ends in '*'
        assert len(_page(client, target=f"/v1/repos/acme/{name}/*").entries) == 3


def test_time_range(store, admin, activity):
    name, _, _ = activity
    with store.client(admin) as client:
        entries = _page(client, repo=f"acme/{name}").entries
        first, last = entries[0].at, entries[-1].at
        assert _page(client, repo=f"acme/{name}", since=(last + dt.timedelta(seconds=1)).isoformat()).entries == []
        assert _page(client, repo=f"acme/{name}", until=first.isoformat()).entries == []
        window = _page(
            client,
            repo=f"acme/{name}",
            since=first.isoformat(),
            until=(last + dt.timedelta(microseconds=1)).isoformat(),
        )
        assert window.entries == entries
        # A time without an offset is UTC.
        naive = first.astimezone(dt.UTC).replace(tzinfo=None).isoformat()
        assert _page(client, repo=f"acme/{name}", since=naive).entries == entries


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_keyset_pages_cover_everything_once(store, admin, activity, order):
    name, _, _ = activity
    with store.client(admin) as client:
        everything = _page(client, repo=f"acme/{name}", order=order).entries
        seen, cursor = [], None
        while True:
            page = _page(client, repo=f"acme/{name}", limit=1, order=order, **({"cursor": cursor} if cursor else {}))
            seen += page.entries
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    ids = [e.id for e in everything]
    assert ids == sorted(ids, reverse=order == "desc") and len(ids) == 5
    assert [e.id for e in seen] == ids


@pytest.mark.parametrize(
    "params",
    [{"limit": 1001}, {"limit": 0}, {"cursor": "abc"}, {"cursor": "-1"}, {"since": "yesterday"}, {"order": "up"}],
)
def test_bad_queries_are_400(store, admin, params):
    with store.client(admin) as client:
        answer = client.get("/v1/audit", params=params)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "BAD_REQUEST"


def test_hostile_filter_values_match_the_stored_form(store, admin):
    """A NUL in a filter is refused (400, like every query value), and a NUL stored escaped is found by its repo."""
    name = unique_repo("nulfilter")
    token = store.mint("mallory", f"acme/{unique_repo()}:write")
    with store.client(token) as client:
        assert client.get(f"/v1/repos/acme/{name}/uploads/a%00b").status_code == 403
    with store.client(admin) as client:
        refused = client.get("/v1/audit", params={"actor": "mal\x00lory"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "BAD_REQUEST"
        found = _page(client, repo=f"acme/{name}").entries
    assert [e.target for e in found] == [f"/v1/repos/acme/{name}/uploads/a\\x00b"]


def test_a_repos_publishes_and_yanks_are_found_by_its_repo(store, admin, pt2_archive):
    """Publish (created, then exists) and yank entries carry the repo, so ``?repo=`` finds a record's history."""
    name = unique_repo("history")
    pub = publication(
        pt2_archive,
        archive_report(pt2_archive),
        components={"consts": safetensors_bytes(CONSTANTS_A)},
        envelope=unique_envelope(),
    )
    with store.client(store.mint("alice", f"acme/{name}:read,write")) as client:
        assert publish(client, "acme", name, pub).status_code == 201
        assert publish(client, "acme", name, pub, send_blobs=False).status_code == 200
    with store.client(admin) as client:
        yanked = client.post(f"/v1/repos/acme/{name}/compiled-graphs/{pub.key}:yank", json={"reason": "bad card"})
        assert yanked.status_code == 200, yanked.text
        entries = _page(client, repo=f"acme/{name}", action="compiled_graph.*").entries
    assert [(e.action, e.detail.get("result")) for e in entries] == [
        ("compiled_graph.publish", "created"),
        ("compiled_graph.publish", "exists"),
        ("compiled_graph.yank", None),
    ]
    assert {e.target for e in entries} == {f"acme/{name}:{pub.key}"}
