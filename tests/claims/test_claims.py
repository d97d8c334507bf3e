"""Mint claims (issue 26 §1): one mint per declaration, on both configurations."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from cgstore.audit.models import AuditEvent
from cgstore.claims import service
from cgstore.claims.models import DeclarationClaim
from cgstore.owners.service import register_principal
from tests.claims.support import beat, claim, fresh_declaration, of_publication, post_claim, release
from tests.compiled_graphs.support import error_code, publication, publish, unique_envelope
from tests.support.live_store import CONFIGURATIONS, unique_repo

KEY = "ck1-" + "a" * 56


def audit_rows(store, action: str, repo: str) -> list[AuditEvent]:
    with store.context.db.session() as session:
        return session.scalars(
            select(AuditEvent).where(AuditEvent.action == action, AuditEvent.repo == repo).order_by(AuditEvent.id)
        ).all()


def slot_of(store, claim_id: str | None = None, repo: str | None = None) -> DeclarationClaim | None:
    with store.context.db.session() as session:
        query = select(DeclarationClaim)
        if claim_id is not None:
            query = query.where(DeclarationClaim.claim == claim_id)
        rows = session.scalars(query).all()
    return rows[0] if rows else None


def test_one_worker_is_granted_the_others_hear_it_is_held(store):
    name = unique_repo()
    first = store.mint("worker-1", f"acme/{name}:read,write")
    second = store.mint("worker-2", f"acme/{name}:read,write")
    declaration = fresh_declaration()
    with store.client(first) as a, store.client(second) as b:
        granted = claim(a, "acme", name, declaration)
        assert granted.state == "granted"
        assert granted.heartbeat_s == pytest.approx(store.settings.claim_ttl_s / 3)
        held = claim(b, "acme", name, declaration)
        assert held.state == "held" and held.claim == granted.claim and held.expires_at == granted.expires_at
        # The holder asking again is told it is held too (its id: it is the one beating it).
        assert claim(a, "acme", name, declaration).state == "held"
        # Another declaration is another claim.
        assert claim(b, "acme", name, fresh_declaration()).state == "granted"
        assert claim(b, "acme", name, {**declaration, "release": "r-2"}).state == "granted"
        beaten = beat(a, "acme", name, granted.claim)
        assert beaten.status_code == 200, beaten.text
        assert beaten.json()["expires_at"] >= granted.expires_at.isoformat().replace("+00:00", "Z")[:19]
        done = release(a, "acme", name, granted.claim, {"outcome": "published", "key": KEY})
        assert done.status_code == 200, done.text
        # Released: the id is gone, and the next claimer is granted at once (no record: it is still a miss).
        assert beat(a, "acme", name, granted.claim).status_code == 404
        assert claim(b, "acme", name, declaration).state == "granted"
    grants = audit_rows(store, service.ACTION_GRANT, f"acme/{name}")
    assert [row.actor for row in grants][:1] == ["worker-1"]
    assert grants[0].detail["discovery_digest"].startswith("blake3:")
    released = audit_rows(store, service.ACTION_RELEASE, f"acme/{name}")
    assert [(row.actor, row.detail["outcome"], row.detail["key"]) for row in released] == [
        ("worker-1", "published", KEY)
    ]


def test_a_live_record_answers_published_with_discovers_candidates(store, pt2_archive, report_a, constants_a):
    name = unique_repo()
    token = store.mint("minter", f"acme/{name}:read,write")
    pub = publication(pt2_archive, report_a, components={"consts": constants_a}, envelope=unique_envelope())
    with store.client(token) as client:
        assert publish(client, "acme", name, pub).status_code == 201
        answer = claim(client, "acme", name, of_publication(pub))
        discovered = client.post("/v1/compiled-graphs:discover", json=of_publication(pub)).json()
    assert answer.state == "published"
    assert [c.key for c in answer.candidates] == [pub.key]
    assert answer.model_dump(mode="json")["candidates"] == discovered["candidates"]


def test_a_publish_by_the_holder_releases_its_claim(store, pt2_archive, report_a, constants_a):
    name = unique_repo()
    token = store.mint("minter", f"acme/{name}:read,write")
    other = store.mint("other", f"acme/{name}:read,write")
    pub = publication(pt2_archive, report_a, components={"consts": constants_a}, envelope=unique_envelope())
    with store.client(token) as client, store.client(other) as stranger:
        granted = claim(client, "acme", name, of_publication(pub))
        assert granted.state == "granted"
        assert publish(client, "acme", name, pub).status_code == 201
        assert beat(client, "acme", name, granted.claim).status_code == 404  # ended by the publish
        assert claim(stranger, "acme", name, of_publication(pub)).state == "published"
    released = audit_rows(store, service.ACTION_RELEASE, f"acme/{name}")
    assert [(r.detail["outcome"], r.detail["key"], r.detail["by"]) for r in released] == [
        ("published", pub.key, "publish")
    ]


def test_a_publish_by_another_principal_leaves_the_claim_held(store, pt2_archive, report_a, constants_a):
    name = unique_repo()
    holder = store.mint("holder", f"acme/{name}:read,write")
    other = store.mint("other", f"acme/{name}:read,write")
    pub = publication(pt2_archive, report_a, components={"consts": constants_a}, envelope=unique_envelope())
    with store.client(holder) as a, store.client(other) as b:
        granted = claim(a, "acme", name, of_publication(pub))
        assert publish(b, "acme", name, pub).status_code == 201
        assert beat(a, "acme", name, granted.claim).status_code == 200


def test_heartbeat_and_release_by_another_principal_answer_as_an_unknown_claim(store):
    name = unique_repo()
    holder = store.mint("holder", f"acme/{name}:read,write")
    other = store.mint("other", f"acme/{name}:read,write")
    with store.client(holder) as a, store.client(other) as b:
        granted = claim(a, "acme", name, fresh_declaration())
        unknown = beat(b, "acme", name, "no-such-claim-id")
        for response in (
            beat(b, "acme", name, granted.claim),
            release(b, "acme", name, granted.claim, {"outcome": "failed", "reason": "nope"}),
            release(b, "acme", name, granted.claim, {"outcome": "published", "key": KEY}),
        ):
            assert response.status_code == 404 and error_code(response) == "NAME_UNKNOWN"
            assert response.json()["error"]["message"] == unknown.json()["error"]["message"]
        # In another repo the holder's own id is unknown too.
        assert beat(a, "acme", unique_repo(), granted.claim).status_code == 404
        assert beat(a, "acme", name, granted.claim).status_code == 200
        assert claim(b, "acme", name, fresh_declaration()).state == "granted"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"outcome": "published"}, "BAD_REQUEST"),
        ({"outcome": "failed", "reason": ""}, "BAD_REQUEST"),
        ({"outcome": "crashed"}, "BAD_REQUEST"),
        ({"outcome": "published", "key": "Not A Key"}, "KEY_INVALID"),
    ],
)
def test_a_bad_release_is_refused_and_the_claim_stays(store, body, code):
    name = unique_repo()
    token = store.mint("holder", f"acme/{name}:read,write")
    with store.client(token) as client:
        granted = claim(client, "acme", name, fresh_declaration())
        response = release(client, "acme", name, granted.claim, body)
        assert response.status_code == 400 and error_code(response) == code, response.text
        assert beat(client, "acme", name, granted.claim).status_code == 200


@pytest.mark.parametrize(
    ("overrides", "status", "code"),
    [
        ({"family": "Bad Family"}, 400, "NAME_INVALID"),
        ({"envelope": {"shapes": [[8, 8]]}}, 422, "ENVELOPE_INVALID"),
        ({"binding_signature": "bs1:nothex"}, 422, "METADATA_INVALID"),
        ({"limit": 3}, 400, "BAD_REQUEST"),  # a claim is a declaration, not a discover query
    ],
)
def test_a_bad_declaration_is_refused_before_anything_is_claimed(store, overrides, status, code):
    name = unique_repo()
    token = store.mint("holder", f"acme/{name}:read,write")
    with store.client(token) as client:
        response = post_claim(client, "acme", name, fresh_declaration(**overrides))
    assert response.status_code == status and error_code(response) == code, response.text


def test_a_read_only_token_cannot_claim_with_the_publish_gates_codes(store):
    name = unique_repo()
    reader = store.mint("reader", f"acme/{name}:read")
    short = store.mint("short-lived", f"acme/{name}:read,write", ttl_s=5)
    with store.client(reader) as client:
        response = post_claim(client, "acme", name, fresh_declaration())
        preflight = client.post(f"/v1/repos/acme/{name}/preflight")
    assert response.status_code == 403 and error_code(response) == "DENIED"
    assert preflight.status_code == 403 and error_code(preflight) == "DENIED"
    with store.client(short) as client:  # cannot hold a claim for its TTL
        response = post_claim(client, "acme", name, fresh_declaration())
    assert response.status_code == 403 and error_code(response) == "DENIED"
    assert response.json()["error"]["detail"]["min_ttl_s"] == int(store.settings.claim_ttl_s)


def test_root_claims_need_a_platform_principal(store):
    family = unique_repo("family")
    tenant = store.mint("tenant-on-root", f"root/{family}:read,write")
    with store.client(tenant) as client:
        response = post_claim(client, "root", family, fresh_declaration())
    assert response.status_code == 403 and error_code(response) == "ROOT_RESERVED"
    assert set(response.json()["error"]["detail"]["missing"]) == {
        "a platform token (plt)",
        "a registered platform principal",
    }
    register_principal(store.context.db, "platform-ci", True)
    platform = store.mint("platform-ci", f"root/{family}:read,write", platform=True)
    with store.client(platform) as client:
        assert claim(client, "root", family, fresh_declaration()).state == "granted"


def test_private_caches_each_principal_claims_its_own(store):
    name = unique_repo()
    owner_token = store.mint("cache-owner", f"acme/{name}:read,write,admin")
    with store.client(owner_token) as client:
        assert client.put(f"/v1/repos/acme/{name}", json={"visibility": "principal"}).status_code in (200, 201)
    a = store.mint("tenant-a", f"acme/{name}:read,write")
    b = store.mint("tenant-b", f"acme/{name}:read,write")
    declaration = fresh_declaration()
    with store.client(a) as ca, store.client(b) as cb:
        granted_a = claim(ca, "acme", name, declaration)
        granted_b = claim(cb, "acme", name, declaration)
        assert granted_a.state == granted_b.state == "granted"  # A's claim neither shows nor blocks
        assert granted_a.claim != granted_b.claim
        assert claim(ca, "acme", name, declaration).claim == granted_a.claim
        assert beat(cb, "acme", name, granted_a.claim).status_code == 404


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_failed_mints_back_off_then_fail_until_an_admin_clears(make_store, configuration):
    store = make_store(configuration, claim_backoff_s=0.2)
    name = unique_repo()
    token = store.mint("minter", f"acme/{name}:read,write")
    declaration = fresh_declaration()
    with store.client(token) as client:
        for failures in range(1, service.FAILING_AFTER + 1):
            granted = claim(client, "acme", name, declaration)
            assert granted.state == "granted", (failures, granted)
            done = release(client, "acme", name, granted.claim, {"outcome": "failed", "reason": f"boom {failures}"})
            assert done.status_code == 200, done.text
            answer = claim(client, "acme", name, declaration)
            if failures < service.FAILING_AFTER:
                assert answer.state == "backoff" and answer.failures == failures and answer.reason == f"boom {failures}"
                time.sleep(0.2 * 2 ** (failures - 1) + 0.05)  # the backoff: 0.2 s × 2^(failures−1)
        assert answer.state == "failing" and answer.failures == service.FAILING_AFTER
        assert claim(client, "acme", name, declaration).state == "failing"
        # The declaration changed (another release): another identity, granted.
        assert claim(client, "acme", name, {**declaration, "release": "fixed"}).state == "granted"
        with store.context.db.session() as session:
            failing = [view for view in service.failing(session, 1000) if view.repo == f"acme/{name}"]
        assert [view.failures for view in failing] == [service.FAILING_AFTER]
        service.clear(store.context.db, failing[0].id, actor="cli", jti=None)
        assert claim(client, "acme", name, declaration).state == "granted"
    released = audit_rows(store, service.ACTION_RELEASE, f"acme/{name}")
    assert [row.detail["outcome"] for row in released] == ["failed"] * service.FAILING_AFTER
    assert len(audit_rows(store, service.ACTION_CLEAR, f"acme/{name}")) == 1


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_an_expired_claim_is_taken_over_at_once_and_counts_toward_failing(make_store, configuration):
    store = make_store(configuration, claim_ttl_s=1.0)
    name = unique_repo()
    tokens = [store.mint(f"worker-{i}", f"acme/{name}:read,write") for i in range(2)]
    declaration = fresh_declaration()
    with store.client(tokens[0]) as a, store.client(tokens[1]) as b:
        first = claim(a, "acme", name, declaration)
        assert claim(b, "acme", name, declaration).state == "held"
        time.sleep(1.1)  # worker-0's mint crashed: nobody beats
        taken = claim(b, "acme", name, declaration)
        assert taken.state == "granted" and taken.claim != first.claim
        assert beat(a, "acme", name, first.claim).status_code == 404
        for _ in range(service.FAILING_AFTER - 1):
            time.sleep(1.1)
            answer = claim(a, "acme", name, declaration)
            if answer.state != "granted":
                break
        assert answer.state == "failing" and answer.reason == service.EXPIRED
    expired = audit_rows(store, service.ACTION_EXPIRE, f"acme/{name}")
    assert len(expired) == service.FAILING_AFTER
    assert expired[0].actor == "worker-0" and expired[0].detail["claim"] == first.claim
    assert expired[0].detail["noticed_by"] == "worker-1"


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_a_beaten_claim_stays_held_past_its_first_ttl(make_store, configuration):
    store = make_store(configuration, claim_ttl_s=1.5)
    name = unique_repo()
    holder = store.mint("holder", f"acme/{name}:read,write")
    other = store.mint("other", f"acme/{name}:read,write")
    declaration = fresh_declaration()
    with store.client(holder) as a, store.client(other) as b:
        granted = claim(a, "acme", name, declaration)
        for _ in range(4):  # 2 s in all: past the first TTL
            time.sleep(granted.heartbeat_s)
            assert beat(a, "acme", name, granted.claim).status_code == 200
        held = claim(b, "acme", name, declaration)
        assert held.state == "held" and held.claim == granted.claim


def test_claims_are_counted_in_the_metrics(store):
    name = unique_repo()
    token = store.mint("holder", f"acme/{name}:read,write")
    with store.client(token) as client:
        granted = claim(client, "acme", name, fresh_declaration())
        scraped = store.scrape_metrics()
        assert 'cgstore_claims_total{outcome="granted"}' in scraped
        in_flight = next(
            float(line.split()[-1]) for line in scraped.splitlines() if line.startswith("cgstore_claims_in_flight ")
        )
        assert in_flight >= 1
        assert release(client, "acme", name, granted.claim, {"outcome": "failed", "reason": "x"}).status_code == 200
    assert 'cgstore_claims_total{outcome="released_failed"}' in store.scrape_metrics()
