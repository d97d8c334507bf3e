"""Owner-name attacks: reserved slugs and look-alikes can never be claimed, and every attempt is audited.

Names are strict ASCII, never normalized (docs/protocol.md "Names"): a look-alike
of ``root`` is not a spelling of ``root`` but an invalid name, 400
``NAME_INVALID``; ``root`` itself (and the other reserved slugs) 403
``ROOT_RESERVED``.
"""

from __future__ import annotations

import uuid

import pytest

from cgstore.audit.models import TARGET_LEN
from cgstore.audit.service import clean
from cgstore.core.names import RESERVED_OWNERS
from tests.security.conftest import code
from tests.support.audit import audited


def claimer(store):
    return store.context.tokens.mint(f"tenant-{uuid.uuid4().hex[:8]}", ["*/*:owner:create,read,write"], 600)


def claim(store, token: str, slug):
    with store.client(token) as client:
        return client.post("/v1/owners", json={"slug": slug})


@pytest.mark.parametrize("slug", sorted(RESERVED_OWNERS))
def test_claiming_a_reserved_slug(store, slug):
    minted = claimer(store)
    answer = claim(store, minted.token, slug)
    assert answer.status_code == 403 and code(answer) == "ROOT_RESERVED"
    assert audited(store, "ROOT_RESERVED", jti=minted.jti)


@pytest.mark.parametrize(
    "slug",
    ["Root", "r\u043e\u043et", "\uff52\uff4f\uff4f\uff54", "root-", "ROOT", "ro\u200bot", "root\n", " root"],
    ids=["Root", "cyrillic-o", "full-width", "root-", "ROOT", "zero-width-space", "newline", "leading-space"],
)
def test_claiming_a_look_alike_of_root(store, slug):
    minted = claimer(store)
    answer = claim(store, minted.token, slug)
    assert answer.status_code == 400 and code(answer) == "NAME_INVALID"
    rows = audited(store, "NAME_INVALID", jti=minted.jti)
    assert rows and rows[0].target == clean(slug, TARGET_LEN) and rows[0].action == "owner.claim"
    assert rows[0].target.isascii()  # a homoglyph shows as the code point it is


def test_claiming_a_name_with_a_nul_is_a_malformed_body(store):
    """NUL never reaches a name check: the one input rule refuses the body first (core/inputs.py)."""
    answer = claim(store, claimer(store).token, "root\x00")
    assert answer.status_code == 400 and code(answer) == "BAD_REQUEST"


def test_claiming_a_taken_owner(store):
    slug = f"acme-{uuid.uuid4().hex[:8]}"
    first, second = claimer(store), claimer(store)
    assert claim(store, first.token, slug).status_code == 201
    answer = claim(store, second.token, slug)
    assert answer.status_code == 409 and code(answer) == "CONFLICT"
    assert audited(store, "CONFLICT", jti=second.jti)
    assert audited(store, "ok", target=slug, jti=first.jti)


def test_claiming_without_owner_create(store):
    minted = store.context.tokens.mint("tenant", ["*/*:read,write"], 600)
    answer = claim(store, minted.token, f"acme-{uuid.uuid4().hex[:8]}")
    assert answer.status_code == 403 and code(answer) == "DENIED"
    assert audited(store, "DENIED", jti=minted.jti)


def test_a_wildcard_grant_does_not_reach_another_tenants_owner(store):
    slug = f"acme-{uuid.uuid4().hex[:8]}"
    owner, intruder = claimer(store), claimer(store)
    assert claim(store, owner.token, slug).status_code == 201
    with store.client(intruder.token) as client:
        answer = client.post(f"/v1/repos/{slug}/models/uploads")
    assert answer.status_code == 403 and code(answer) == "DENIED"
    assert "not held" in answer.json()["error"]["message"]
    assert audited(store, "DENIED", target=slug, jti=intruder.jti)
    with store.client(owner.token) as client:
        assert client.post(f"/v1/repos/{slug}/models/uploads").status_code == 202
