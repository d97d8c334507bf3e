"""Batch resolve, read, list and yank (docs/protocol.md "Compiled graphs"), on both configurations."""

from __future__ import annotations

import time

import httpx
import pytest
from sqlalchemy import event, select, update

from cgstore.audit.models import AuditEvent
from cgstore.compiled_graphs.models import CompiledGraph
from cgstore_client.wire.records import (
    MAX_FREE_FORM_BYTES,
    MAX_PAGE_BYTES,
    MAX_RESOLVE_KEYS,
    Record,
    RecordPage,
    ResolveAnswer,
)
from tests.compiled_graphs.support import FAMILY, error_code, publication, publish, unique_envelope, upload_all
from tests.support.live_store import unique_repo


@pytest.fixture
def published(store, pt2_archive, report_a, constants_a):
    """Archive A published in a fresh tenant repo ``acme/<name>``; returns (name, token, publication)."""
    name = unique_repo()
    token = store.mint("minter", f"acme/{name}:read,write")
    pub = publication(
        pt2_archive,
        report_a,
        components={"consts": constants_a},
        envelope={"shapes": [[64, 64]], "text_len": 77, "guidance": [unique_guidance()]},
    )
    with store.client(token) as client:
        assert publish(client, "acme", name, pub).status_code == 201
    return name, token, pub


_counter = iter(range(1, 10**6))


def unique_guidance() -> str:
    """A fresh envelope per test (so a fresh key), without touching the archive."""
    return f"{next(_counter)}.5"


def resolve(client: httpx.Client, keys: list[str], family: str = FAMILY) -> httpx.Response:
    return client.post("/v1/compiled-graphs:resolve", json={"family": family, "keys": keys})


def absent_key(n: int = 0) -> str:
    return "ck1-" + f"{n:056x}"


def test_resolve_keeps_order_answers_duplicates_and_misses(store, published):
    name, token, pub = published
    keys = [absent_key(1), pub.key, absent_key(2), pub.key]
    with store.client(token) as client:
        response = resolve(client, keys)
    assert response.status_code == 200, response.text
    answers = ResolveAnswer.model_validate_json(response.content).answers
    assert [a.key for a in answers] == keys
    assert [a.status for a in answers] == ["miss", "hit", "miss", "hit"]
    hit = answers[1]
    assert hit.repo == f"acme/{name}"
    assert hit.artifact.digest == pub.artifact.digest and hit.artifact.size == pub.artifact.size
    assert [(c.name, c.digest) for c in hit.components] == [("consts", pub.components["consts"].digest)]
    assert hit.record.graph == pub.manifest["axes"]["graph"] and hit.record.lane == "baseline+packed"
    assert response.json()["answers"][0] == {"key": absent_key(1), "status": "miss"}


def test_answer_bytes_are_exactly_what_the_wire_type_serializes(store, published):
    """The store serializes plain data, not models: the bytes must still be ``ResolveAnswer``'s own."""
    _, token, pub = published
    with store.client(token) as client:
        response = resolve(client, [pub.key, absent_key(3), pub.key])
    assert response.status_code == 200, response.text
    answer = ResolveAnswer.model_validate_json(response.content)
    assert [a.status for a in answer.answers] == ["hit", "miss", "hit"]
    assert answer.answers[0].record.layout is not None and answer.answers[0].components
    assert response.content == answer.model_dump_json().encode()


def test_hit_urls_download_the_exact_bytes(store, published):
    name, token, pub = published
    with store.client(token) as client:
        hit = resolve(client, [pub.key]).json()["answers"][0]
    artifact_url, component_url = hit["artifact"]["url"], hit["components"][0]["url"]
    if store.is_s3:
        # Presigned: straight from storage, no store token.
        assert not artifact_url.startswith(store.base_url)
        artifact, component = httpx.get(artifact_url), httpx.get(component_url)
    else:
        # A path relative to the store (no CGSTORE_PUBLIC_URL here): never a host the request named.
        assert artifact_url == f"/v1/repos/acme/{name}/blobs/{pub.artifact.digest}"
        with store.client(token) as client:
            artifact, component = client.get(artifact_url), client.get(component_url)
    assert artifact.content == pub.artifact.data
    assert component.content == pub.components["consts"].data


def test_another_family_misses(store, published):
    _, token, pub = published
    with store.client(token) as client:
        assert resolve(client, [pub.key], family="other-family").json()["answers"][0]["status"] == "miss"


def test_root_wins_over_a_tenant_repo_holding_the_same_key(store, pt2_archive, report_a, constants_a):
    tenant = unique_repo()
    platform_repo = unique_repo("family")
    pub = publication(
        pt2_archive,
        report_a,
        components={"consts": constants_a},
        envelope={"shapes": [[32, 32]], "text_len": 1, "guidance": [unique_guidance()]},
    )
    tenant_token = store.mint("tenant", f"acme/{tenant}:read,write")
    platform_token = store.mint("ci", f"root/{platform_repo}:read,write", platform=True)
    with store.client(tenant_token) as client:
        assert publish(client, "acme", tenant, pub).status_code == 201
        assert resolve(client, [pub.key]).json()["answers"][0]["repo"] == f"acme/{tenant}"
    with store.client(platform_token) as client:
        assert publish(client, "root", platform_repo, pub).status_code == 201
    with store.client(tenant_token) as client:
        assert resolve(client, [pub.key]).json()["answers"][0]["repo"] == f"root/{platform_repo}"


def test_unreadable_tenant_record_answers_exactly_like_an_absent_key(store, published):
    _, _, pub = published
    outsider = store.mint("mallory", "evil/*:read,write")
    absent = absent_key(7)
    with store.client(outsider) as client:
        hidden = resolve(client, [pub.key])
        missing = resolve(client, [absent])
    assert hidden.status_code == missing.status_code == 200
    assert hidden.content == missing.content.replace(absent.encode(), pub.key.encode())
    strip = {"date", "content-length"}
    assert {k: v for k, v in hidden.headers.items() if k not in strip} == {
        k: v for k, v in missing.headers.items() if k not in strip
    }
    assert len(hidden.content) == len(missing.content)


def test_principal_repo_shows_a_reader_only_their_own_records(store, pt2_archive, report_a, constants_a):
    name = unique_repo()
    manager = store.mint("ops", f"acme/{name}:admin")
    writer = store.mint("release-a", f"acme/{name}:read,write")
    reader = store.mint("release-b", f"acme/{name}:read")
    with store.client(manager) as client:
        created = client.put(f"/v1/repos/acme/{name}", json={"visibility": "principal"})
        assert created.status_code == 201, created.text
    pub = publication(
        pt2_archive,
        report_a,
        components={"consts": constants_a},
        envelope={"shapes": [[16, 16]], "text_len": 3, "guidance": [unique_guidance()]},
    )
    with store.client(writer) as client:
        assert publish(client, "acme", name, pub).status_code == 201
        assert resolve(client, [pub.key]).json()["answers"][0]["status"] == "hit"
        assert client.get(pub.path("acme", name)).status_code == 200
    with store.client(reader) as client:
        assert resolve(client, [pub.key]).json()["answers"][0] == {"key": pub.key, "status": "miss"}
        assert client.get(pub.path("acme", name)).status_code == 404
        assert client.get(f"/v1/repos/acme/{name}/compiled-graphs").json()["records"] == []


def test_yank_is_admin_only_audited_misses_and_the_key_can_be_minted_again(store, published):
    name, token, pub = published
    admin = store.mint("admin", "*/*:admin")
    with store.client(token) as client:
        denied = client.post(f"{pub.path('acme', name)}:yank", json={"reason": "bad numerics"})
        assert denied.status_code == 403 and error_code(denied) == "DENIED"
    with store.client(admin) as client:
        no_reason = client.post(f"{pub.path('acme', name)}:yank", json={})
        assert no_reason.status_code == 400
        yanked = client.post(f"{pub.path('acme', name)}:yank", json={"reason": "bad numerics"})
    assert yanked.status_code == 200, yanked.text
    record = Record.model_validate_json(yanked.content)
    assert record.yank.reason == "bad numerics" and record.yank.by == "admin"
    with store.client(token) as client:
        assert resolve(client, [pub.key]).json()["answers"][0] == {"key": pub.key, "status": "miss"}
        assert client.get(pub.path("acme", name)).status_code == 404
        again = client.put(pub.path("acme", name), json=pub.manifest)
        assert again.status_code == 201, again.text
        assert resolve(client, [pub.key]).json()["answers"][0]["status"] == "hit"
    with store.context.db.session() as session:
        actions = session.scalars(
            select(AuditEvent.action).where(AuditEvent.target == f"acme/{name}:{pub.key}").order_by(AuditEvent.id)
        ).all()
    assert actions == ["compiled_graph.publish", "compiled_graph.yank", "compiled_graph.publish"]


def test_an_unhealthy_record_misses_like_an_absent_one(store, published):
    name, token, pub = published
    with store.client(token) as client:
        assert resolve(client, [pub.key]).json()["answers"][0]["status"] == "hit"
    # The scrub (another feature) marks records whose bytes went missing: set the column it sets.
    with store.context.db.session() as session:
        session.execute(update(CompiledGraph).where(CompiledGraph.key == pub.key).values(health="blob_missing"))
    with store.client(token) as client:
        assert resolve(client, [pub.key]).json()["answers"][0] == {"key": pub.key, "status": "miss"}


def test_too_many_keys_is_400(store, published):
    _, token, _ = published
    with store.client(token) as client:
        assert resolve(client, [absent_key(i) for i in range(MAX_RESOLVE_KEYS)]).status_code == 200
        too_many = resolve(client, [absent_key(i) for i in range(MAX_RESOLVE_KEYS + 1)])
        bad_key = resolve(client, ["NOT A KEY"])
    assert too_many.status_code == 400 and error_code(too_many) == "BAD_REQUEST"
    assert bad_key.status_code == 400 and error_code(bad_key) == "KEY_INVALID"


def test_resolve_needs_a_token(store):
    response = httpx.post(f"{store.base_url}/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": ["a"]})
    assert response.status_code == 401 and error_code(response) == "UNAUTHORIZED"


def test_resolve_runs_the_same_number_of_sql_statements_for_1_and_256_keys(store, published):
    _, token, pub = published
    engine = store.context.db.engine
    statements: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        # Not a setting of the transaction (plan_without_values), no query; nor the events feed's head, which
        # the store polls in the background while a worker of another test long-polls (core.feeds.HeadWatch).
        if not statement.startswith("SET LOCAL ") and "record_events" not in statement:
            statements.append(statement)

    def measured(keys: list[str]) -> int:
        statements.clear()
        event.listen(engine, "before_cursor_execute", count)
        try:
            with store.client(token) as client:
                answers = resolve(client, keys).json()["answers"]
        finally:
            event.remove(engine, "before_cursor_execute", count)
        assert answers[0]["status"] == "hit"
        return len(statements)

    # The fixture's publish woke the long-polls that workers of earlier tests may have left (each reads what
    # it may see, then waits on): let those reads end before counting.
    time.sleep(1)
    one = measured([pub.key])
    many = measured([pub.key] + [absent_key(i) for i in range(MAX_RESOLVE_KEYS - 1)])
    assert one == many
    assert one <= 6  # token check + records + components, whatever the key count


def test_resolve_metrics_count_hits_and_misses(store, published):
    _, token, pub = published
    with store.client(token) as client:
        resolve(client, [pub.key, absent_key(3)])
        metrics = client.get("/metrics", headers=store.metrics_headers()).text
    # No allow-list on this store: the family is not a label (tests/security/test_metrics_access.py).
    assert 'cgstore_resolve_answers_total{family="other",status="hit"}' in metrics
    assert 'cgstore_resolve_answers_total{family="other",status="miss"}' in metrics


def test_get_of_an_unreadable_record_is_404_like_an_absent_one(store, published):
    name, _, pub = published
    outsider = store.mint("mallory", "evil/*:read")
    with store.client(outsider) as client:
        hidden = client.get(pub.path("acme", name))
        absent = client.get(f"/v1/repos/acme/{name}/compiled-graphs/{absent_key(9)}")
    assert hidden.status_code == absent.status_code == 404
    assert error_code(hidden) == error_code(absent) == "NAME_UNKNOWN"


def test_list_filters_and_paginates_by_keyset(store, pt2_archive, report_a, constants_a):
    name = unique_repo()
    token = store.mint("minter", f"acme/{name}:read,write")
    pubs = [
        publication(
            pt2_archive,
            report_a,
            components={"consts": constants_a},
            envelope={"shapes": [[8 * (i + 1), 8]], "text_len": 0},
        )
        for i in range(5)
    ]
    with store.client(token) as client:
        for pub in pubs:
            assert publish(client, "acme", name, pub).status_code == 201
        seen, cursor = [], None
        while True:
            params = {"limit": 2, "family": FAMILY, "sm": report_a.sm, **({"cursor": cursor} if cursor else {})}
            page = RecordPage.model_validate_json(
                client.get(f"/v1/repos/acme/{name}/compiled-graphs", params=params).content
            )
            seen += [record.key for record in page.records]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert seen == [pub.key for pub in pubs]
        assert client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={"family": "nope"}).json()["records"] == []
        assert (
            client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={"lane": "fused+dense"}).json()["records"] == []
        )
        assert client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={"limit": 1001}).status_code == 400
        assert client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={"cursor": "x"}).status_code == 400


def list_all(client: httpx.Client, name: str, **params) -> list[RecordPage]:
    """Every page of a listing, following ``next_cursor``; each answer is checked against the byte bound."""
    pages, cursor = [], None
    while True:
        answer = client.get(
            f"/v1/repos/acme/{name}/compiled-graphs", params={**params, **({"cursor": cursor} if cursor else {})}
        )
        assert answer.status_code == 200, answer.text
        assert len(answer.content) <= MAX_PAGE_BYTES
        pages.append(RecordPage.model_validate_json(answer.content))
        if pages[-1].next_cursor is None:
            return pages
        cursor = pages[-1].next_cursor


def test_a_listing_page_is_cut_by_bytes_and_the_cursor_goes_on(store, pt2_archive, report_a, constants_a):
    """Issue 15 §6: records with evidence near its bound, asked 1000 at a time, answer pages under MAX_PAGE_BYTES."""
    name = unique_repo()
    token = store.mint("minter", f"acme/{name}:read,write")
    padding = {"pad": "x" * (MAX_FREE_FORM_BYTES - 64)}
    pubs = [
        publication(
            pt2_archive,
            report_a,
            components={"consts": constants_a},
            envelope={"shapes": [[8 * (i + 1), 8]], "text_len": 0},
            evidence={"kernel_lane_evidence": padding, "mint_phases": padding},
        )
        for i in range(2 * MAX_PAGE_BYTES // (2 * MAX_FREE_FORM_BYTES) + 2)
    ]
    with store.client(token) as client:
        upload_all(client, "acme", name, pubs[0])  # every publication names the same blobs
        for pub in pubs:
            assert publish(client, "acme", name, pub, send_blobs=False).status_code == 201
        pages = list_all(client, name, limit=1000)
        one_by_one = list_all(client, name, limit=1)
    assert len(pages) >= 3 and all(0 < len(page.records) < len(pubs) for page in pages)
    assert [record.key for page in pages for record in page.records] == [pub.key for pub in pubs]
    assert [page.records[0].key for page in one_by_one] == [pub.key for pub in pubs]


def test_openapi_schema_uses_the_wire_types(store):
    schema = httpx.get(f"{store.base_url}/openapi.json").json()
    resolve_op = schema["paths"]["/v1/compiled-graphs:resolve"]["post"]
    assert resolve_op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResolveRequest")
    assert resolve_op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResolveAnswer")
    keys = schema["components"]["schemas"]["ResolveRequest"]["properties"]["keys"]
    assert keys["maxItems"] == MAX_RESOLVE_KEYS
    assert "receipt" in schema["components"]["schemas"]["PublishAnswer"]["properties"]


def test_capabilities_state_the_resolve_limit(store):
    capabilities = httpx.get(f"{store.base_url}/v1/capabilities").json()
    assert capabilities["max_resolve_keys"] == MAX_RESOLVE_KEYS
    assert capabilities["accepted_kinds"] == ["aot-inductor"]


def test_resolve_searches_root_then_held_owners_then_named_ones_never_another_tenant_s_by_wildcard(
    store, pt2_archive, report_a, constants_a
):
    """Two tenants publish one key under their own owners; ``aa-`` sorts first, yet each resolves its own."""
    suffix = unique_repo("")
    owners = {"first": f"aa{suffix}", "second": f"zz{suffix}"}
    pub = publication(pt2_archive, report_a, components={"consts": constants_a}, envelope=unique_envelope())
    tenants = {}
    for tenant, owner in owners.items():
        tenants[tenant] = store.mint(f"tenant{suffix}-{tenant}", "*/*:read,write,owner:create")
        with store.client(tenants[tenant]) as client:
            assert client.post("/v1/owners", json={"slug": owner}).status_code == 201
            assert publish(client, owner, "cache", pub).status_code == 201
    for tenant, owner in owners.items():
        with store.client(tenants[tenant]) as client:
            assert resolve(client, [pub.key]).json()["answers"][0]["repo"] == f"{owner}/cache"
    named = store.mint(f"named{suffix}", f"{owners['second']}/*:read", f"{owners['first']}/*:read")
    wildcard = store.mint(f"reader{suffix}", "*/*:read")
    with store.client(named) as client:  # both named literally, neither held: by owner name
        assert resolve(client, [pub.key]).json()["answers"][0]["repo"] == f"{owners['first']}/cache"
    with store.client(wildcard) as client:  # a wildcard reads there, but never runs another tenant's artifact
        assert resolve(client, [pub.key]).json()["answers"][0] == {"key": pub.key, "status": "miss"}
        assert client.get(pub.path(owners["first"], "cache")).status_code == 200
