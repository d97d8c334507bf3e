"""Attacks on the token itself: each refused with 401 ``TOKEN_INVALID`` and audited (both configurations).

Each forged token is presented to a real read of a real blob; the refusal must
name the layer that caught it, so a test cannot pass because an earlier layer
happened to refuse for another reason.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cgstore.tokens.ring import key_id
from cgstore.tokens.service import LEEWAY_S, TokenService
from tests.security.conftest import b64, b64json, code, decode_unverified, payload, sign, store_key
from tests.support.audit import audited


def refused(store, target, token: str, reason: str) -> None:
    """The read answers 401 TOKEN_INVALID for ``reason``, and the refusal is audited."""
    with store.client(token) as client:
        answer = client.get(target["url"])
    assert answer.status_code == 401, answer.text
    assert code(answer) == "TOKEN_INVALID"
    assert reason in answer.json()["error"]["message"]
    assert answer.headers["www-authenticate"].startswith("Bearer")
    assert audited(store, "TOKEN_INVALID", target=target["name"]), "the refusal was not audited"


def test_alg_none(store, target):
    header = b64json({"alg": "none", "typ": "JWT"})
    refused(store, target, f"{header}.{b64json(payload(store))}.", "algorithm")


def test_hs256_with_the_public_key_as_secret(store, target):
    kid, key = store_key(store)
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    signing_input = f"{b64json({'alg': 'HS256', 'typ': 'JWT', 'kid': kid})}.{b64json(payload(store))}"
    signature = hmac.new(public_pem, signing_input.encode(), hashlib.sha256).digest()
    refused(store, target, f"{signing_input}.{b64(signature)}", "algorithm")


def test_signed_by_an_unknown_key_under_a_real_kid(store, target):
    kid, _ = store_key(store)
    refused(store, target, sign(payload(store), Ed25519PrivateKey.generate(), kid=kid), "signature does not verify")


def test_unknown_kid(store, target):
    stranger = Ed25519PrivateKey.generate()
    refused(store, target, sign(payload(store), stranger, kid=key_id(stranger.public_key())), "unknown key")


def test_no_kid(store, target):
    _, key = store_key(store)
    refused(store, target, sign(payload(store), key), "unknown key")


def test_wrong_aud(store, target):
    kid, key = store_key(store)
    refused(store, target, sign(payload(store, aud="other-service"), key, kid=kid), "audience")


def test_wrong_iss(store, target):
    kid, key = store_key(store)
    refused(store, target, sign(payload(store, iss="evil-issuer"), key, kid=kid), "issuer")


def test_expired(store, target):
    past = TokenService(
        store.context.db, store.settings, ring=store.context.tokens.ring, clock=lambda: time.time() - 7200
    )
    expired = past.mint("victim", [f"acme/{target['name']}:read"], 3600).token
    refused(store, target, expired, "expired")


def test_expiry_is_judged_with_the_clock_skew_leeway(store, target):
    """``exp`` tolerates LEEWAY_S (10 s) of skew: expired 5 s ago still reads; expired 15 s ago is 401."""

    def minted_expired(ago_s: int) -> str:
        ttl_s = 60
        past = TokenService(
            store.context.db,
            store.settings,
            ring=store.context.tokens.ring,
            clock=lambda: time.time() - ttl_s - ago_s,
        )
        return past.mint("victim", [f"acme/{target['name']}:read"], ttl_s).token

    assert LEEWAY_S == 10
    with store.client(minted_expired(5)) as client:
        assert client.get(target["url"]).status_code in (200, 307)  # the bytes, or (production) a redirect to them
    refused(store, target, minted_expired(15), "expired")


def test_not_yet_valid(store, target):
    kid, key = store_key(store)
    refused(store, target, sign(payload(store, nbf=int(time.time()) + 3600), key, kid=kid), "not yet valid")


def test_not_yet_valid_nbf_must_be_an_integer(store, target):
    kid, key = store_key(store)
    refused(store, target, sign(payload(store, nbf="soon"), key, kid=kid), "nbf")


def test_revoked(store, target):
    minted = store.context.tokens.mint("victim", [f"acme/{target['name']}:read"], 3600)
    admin = store.mint("sec-admin", "*/*:admin")
    with store.client(admin) as client:
        assert client.delete(f"/v1/tokens/{minted.jti}").json() == {"revoked": 1}
    refused(store, target, minted.token, "token was revoked")


def test_child_of_a_revoked_parent(store, target):
    parent = store.context.tokens.mint("job", [f"acme/{target['name']}:read"], 3600)
    with store.client(parent.token) as client:
        answer = client.post(
            "/v1/tokens/attenuate",
            json={"grants": [{"repo": f"acme/{target['name']}", "actions": ["read"]}], "ttl_s": 60},
        )
    assert answer.status_code == 201
    child = answer.json()
    with store.client(child["token"]) as client:
        assert client.get(target["url"]).status_code in (200, 307)
    store.context.tokens.revoke(parent.jti)
    # The cascade marked the child too; even unmarked, verify walks to the revoked parent.
    refused(store, target, child["token"], "revoked")


@pytest.mark.parametrize(
    "change",
    [
        {"grants": [{"repo": "*/*", "actions": ["read", "write", "admin"]}]},
        {"plt": True},
        {"exp_extra_s": 10 * 24 * 3600},
        {"sub": "someone-else"},
        {"extra_claim": "x"},
    ],
    ids=["wider-grants", "plt", "later-exp", "other-sub", "added-claim"],
)
def test_recorded_jti_resigned_with_other_claims(store, target, change):
    """The store's own key (any accepted key) signing a recorded jti with other claims: refused."""
    minted = store.context.tokens.mint("victim", [f"acme/{target['name']}:read"], 600)
    claims = decode_unverified(minted.token)
    change = dict(change)
    claims["exp"] += change.pop("exp_extra_s", 0)
    claims.update(change)
    kid, key = store_key(store)
    refused(store, target, sign(claims, key, kid=kid), "claims differ from its record")


def test_recorded_jti_resigned_by_another_accepted_key(store, target):
    minted = store.context.tokens.mint("victim", [f"acme/{target['name']}:read"], 600)
    with store.context.db.session() as session:
        kid = store.context.tokens.ring.rotate(session)
    _, key = store_key(store)
    assert key_id(key.public_key()) == kid
    claims = dict(decode_unverified(minted.token), grants=[{"repo": "*/*", "actions": ["write"]}])
    refused(store, target, sign(claims, key, kid=kid), "claims differ from its record")
    # Even the record's own claims under another key: a token lives and dies with its key.
    refused(store, target, sign(decode_unverified(minted.token), key, kid=kid), "another key than the one")


def test_unrecorded_jti_signed_by_the_store_key(store, target):
    kid, key = store_key(store)
    refused(store, target, sign(payload(store, jti=uuid.uuid4().hex), key, kid=kid), "unknown token")


def test_tokens_are_never_stored_in_clear(store, target):
    minted = store.context.tokens.mint("victim", [f"acme/{target['name']}:read"], 600)
    signature = minted.token.rsplit(".", 1)[1]
    with store.context.db.engine.connect() as conn:
        for table in ("tokens", "audit_events"):
            rows = conn.exec_driver_sql(f"SELECT * FROM {table}").all()
            assert signature not in json.dumps([list(map(str, row)) for row in rows])
