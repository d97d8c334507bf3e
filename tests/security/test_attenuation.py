"""Attenuation attacks over HTTP: a child wider than its parent in any part is 403 naming it, and audited."""

from __future__ import annotations

import pytest

from tests.security.conftest import code, decode_unverified
from tests.support.audit import audited
from tests.support.live_store import unique_repo


def attenuate(store, parent_token: str, body: dict):
    with store.client(parent_token) as client:
        return client.post("/v1/tokens/attenuate", json=body)


def assert_wider(store, parent, answer, named: str) -> None:
    assert answer.status_code == 403, answer.text
    assert code(answer) == "DENIED"
    wider = answer.json()["error"]["detail"]["wider"]
    assert any(named in part for part in wider), wider
    assert named in answer.json()["error"]["message"]
    assert audited(store, "DENIED", jti=parent.jti), "the refusal was not audited"


@pytest.mark.parametrize(
    ("grants", "named"),
    [
        ([{"repo": "acme/*", "actions": ["read", "write"]}], "grant acme/*:read,write"),
        ([{"repo": "*/*", "actions": ["read"]}], "grant */*:read"),
        ([{"repo": "acme-evil/x", "actions": ["read"]}], "grant acme-evil/x:read"),
        ([{"repo": "root/x", "actions": ["read"]}], "grant root/x:read"),
    ],
    ids=["more-repos", "wildcard-owner", "look-alike-owner", "root"],
)
def test_widening_grants(store, grants, named):
    name = unique_repo()
    parent = store.context.tokens.mint("job", [f"acme/{name}:read,write"], 3600)
    assert_wider(store, parent, attenuate(store, parent.token, {"grants": grants, "ttl_s": 60}), named)


def test_lengthening_life(store):
    parent = store.context.tokens.mint("job", [f"acme/{unique_repo()}:read"], 600)
    body = {"grants": decode_unverified(parent.token)["grants"], "ttl_s": 601 + 15}
    assert_wider(store, parent, attenuate(store, parent.token, body), "exp")


def test_adding_plt(store):
    parent = store.context.tokens.mint("tenant", [f"acme/{unique_repo()}:write"], 600)
    body = {"grants": decode_unverified(parent.token)["grants"], "ttl_s": 60, "platform": True}
    assert_wider(store, parent, attenuate(store, parent.token, body), "plt")


def test_adding_admin(store):
    name = unique_repo()
    parent = store.context.tokens.mint("tenant", [f"acme/{name}:read,write"], 600)
    body = {"grants": [{"repo": f"acme/{name}", "actions": ["admin"]}], "ttl_s": 60}
    assert_wider(store, parent, attenuate(store, parent.token, body), "admin")


def test_adding_store_admin(store):
    parent = store.context.tokens.mint("tenant", ["acme/*:read,write"], 600)
    body = {"grants": [{"repo": "*/*", "actions": ["admin"]}], "ttl_s": 60}
    assert_wider(store, parent, attenuate(store, parent.token, body), "*/*:admin")


def test_every_wider_part_is_named_at_once(store):
    parent = store.context.tokens.mint("tenant", ["acme/x:read"], 600)
    body = {"grants": [{"repo": "acme/*", "actions": ["write"]}], "ttl_s": 7200, "platform": True}
    answer = attenuate(store, parent.token, body)
    assert answer.status_code == 403
    wider = answer.json()["error"]["detail"]["wider"]
    assert len(wider) == 3 and wider[0].startswith("grant") and "exp" in wider[1] and "plt" in wider[2]


def test_narrower_child_is_minted_recorded_and_audited(store):
    name = unique_repo()
    parent = store.context.tokens.mint("platform-ci", [f"root/{name}:read,write"], 600, platform=True)
    body = {"grants": [{"repo": f"root/{name}", "actions": ["write"]}], "ttl_s": 120}
    answer = attenuate(store, parent.token, body)
    assert answer.status_code == 201, answer.text
    child = decode_unverified(answer.json()["token"])
    assert child["parent"] == parent.jti and child["plt"] is True and child["exp"] <= parent.exp
    assert audited(store, "ok", target=answer.json()["jti"], jti=parent.jti)
    # Dropping plt is narrowing, and allowed.
    dropped = attenuate(store, parent.token, {**body, "platform": False})
    assert dropped.status_code == 201 and decode_unverified(dropped.json()["token"])["plt"] is False
