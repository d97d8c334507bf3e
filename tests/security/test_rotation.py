"""Key rotation end to end against a running store, through the operator's CLI, without a restart.

Mint with key 1, ``cgstore keys rotate``, mint with key 2: both verify and the
JWKS serves both. ``cgstore keys retire KID1``: key 1's tokens answer 401 on
the next request, key 2's keep working, the JWKS drops key 1. The store keeps
running throughout (the same process, the same port).

Retiring the key that signs now, while a publish is between its receipt's
signature and its commit, must neither let the retirement commit first nor
strand the record with a receipt only the retired key verifies.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from cgstore.compiled_graphs import receipts
from cgstore_client.receipts import verify_receipt
from tests.compiled_graphs.support import CONSTANTS_A, FAMILY, publication, safetensors_bytes, upload_all
from tests.security.conftest import code
from tests.support.archives import archive_report
from tests.support.audit import audited
from tests.support.live_store import CONFIGURATIONS, running_store, unique_repo

CGSTORE = [sys.executable, "-m", "cgstore.cli"]


def cli(live, *args: str) -> str:
    env = {**os.environ, "CGSTORE_HOME": str(live.settings.home)}
    if live.settings.database_url:
        env["CGSTORE_DATABASE_URL"] = live.settings.database_url
    done = subprocess.run([*CGSTORE, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def mint_over_http(live, admin: str, name: str) -> str:
    body = {"sub": "writer", "grants": [{"repo": f"acme/{name}", "actions": ["read", "write"]}], "ttl_s": 3600}
    with live.client(admin) as client:
        answer = client.post("/v1/tokens", json=body)
    assert answer.status_code == 201, answer.text
    return answer.json()["token"]


def mint_over_http_admin(live, admin: str) -> str:
    with live.client(admin) as client:
        answer = client.post(
            "/v1/tokens", json={"sub": "ops", "grants": [{"repo": "*/*", "actions": ["admin"]}], "ttl_s": 600}
        )
    assert answer.status_code == 201
    return answer.json()["token"]


def works(live, token: str, name: str) -> int:
    with live.client(token) as client:
        return client.post(f"/v1/repos/acme/{name}/preflight").status_code


def jwks_kids(live) -> list[str]:
    with live.client() as client:
        keys = client.get("/v1/keys").json()["keys"]
    for key in keys:
        assert set(key) == {"kty", "crv", "x", "kid", "alg", "use"}  # never "d"
    return [key["kid"] for key in keys]


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_rotate_and_retire_without_restart(make_store, configuration):
    live = make_store(configuration)
    name = unique_repo()
    admin1 = live.mint("ops", "*/*:admin")
    token1 = mint_over_http(live, admin1, name)
    kid1 = jwt.get_unverified_header(token1)["kid"]
    assert works(live, token1, name) == 204

    kid2 = cli(live, "keys", "rotate")
    assert kid2 != kid1 and len(kid2) == 16
    token2 = mint_over_http(live, admin1, name)  # the running store signs with the new key at once
    assert jwt.get_unverified_header(token2)["kid"] == kid2
    assert works(live, token1, name) == works(live, token2, name) == 204
    assert {kid1, kid2} <= set(jwks_kids(live))

    admin2 = mint_over_http_admin(live, admin1)
    assert cli(live, "keys", "retire", kid1) == f"retired {kid1}"
    with live.client(token1) as client:
        refused = client.post(f"/v1/repos/acme/{name}/preflight")
    assert refused.status_code == 401 and code(refused) == "TOKEN_INVALID"
    assert "retired" in refused.json()["error"]["message"]
    assert audited(live, "TOKEN_INVALID", target=name)
    assert works(live, admin1, name) == 401  # the admin token of key 1 died with it
    assert works(live, token2, name) == 204
    assert kid1 not in jwks_kids(live) and kid2 in jwks_kids(live)
    with live.client(admin2) as client:
        assert client.get("/v1/tokens").status_code == 200
    listing = cli(live, "keys", "list")
    assert kid1 in listing and kid2 in listing and "-----BEGIN" not in listing
    assert audited(live, "ok", target=kid2) and audited(live, "ok", target=kid1)  # key.rotate, key.retire


def test_a_token_verifies_with_only_the_jwks(store):
    """What a third party can do: verify a store token with ``GET /v1/keys`` and PyJWT alone."""
    token = store.mint("alice", f"acme/{unique_repo()}:read")
    with store.client() as client:
        keys = {key["kid"]: key for key in client.get("/v1/keys").json()["keys"]}
    jwk = keys[jwt.get_unverified_header(token)["kid"]]
    public = jwt.PyJWK(jwk).key
    assert isinstance(public, Ed25519PublicKey)
    claims = jwt.decode(token, public, algorithms=["EdDSA"], audience="cgstore")
    assert claims["sub"] == "alice"


@pytest.fixture
def own_ring_store(store, tmp_path):
    """A store with a key ring of its own (its own home) on ``store``'s database and storage.

    Retiring the shared store's key would kill every other test's tokens; sharing
    its storage keeps the blobs ``store`` already recorded readable (production).
    """
    with running_store(store.settings.model_copy(update={"home": tmp_path / "home"}), store.configuration) as live:
        yield live


def test_retiring_the_signing_key_waits_for_an_in_flight_publish(own_ring_store, pt2_archive, monkeypatch):
    """Publish signs with key 2, then ``retire`` key 2 starts, then the publish commits.

    The retirement must wait for the publish's transaction, then re-sign the
    record: the record, its resolve hit and a 200 re-publish all answer a
    receipt the JWKS verifies. Before, the retirement committed in between and
    the record kept a receipt of the retired key forever.
    """
    live = own_ring_store
    name = unique_repo("race")
    keys = live.context.tokens.ring
    token = live.mint("minter", f"acme/{name}:read,write")  # key 1: outlives key 2's retirement
    pub = publication(pt2_archive, archive_report(pt2_archive), components={"consts": safetensors_bytes(CONSTANTS_A)})
    with live.client(token) as client:
        upload_all(client, "acme", name, pub)
    with live.context.db.session() as session:
        signing_now = keys.rotate(session)

    signed, release = threading.Event(), threading.Event()
    stamp = receipts.stamp

    def stamp_then_pause(*args, **kwargs):
        stamp(*args, **kwargs)
        if not signed.is_set():
            signed.set()
            release.wait(60)

    monkeypatch.setattr(receipts, "stamp", stamp_then_pause)
    answers, retired = [], []

    def publish() -> None:
        with live.client(token) as client:
            answers.append(client.put(pub.path("acme", name), json=pub.manifest))

    def retire() -> None:
        with live.context.db.session() as session:
            retired.append(receipts.retire(session, keys, issuer=live.settings.token_issuer, kid=signing_now))

    publishing, retiring = threading.Thread(target=publish), threading.Thread(target=retire)
    publishing.start()
    assert signed.wait(30), "the publish never signed"
    retiring.start()
    # Bounded only for the broken case: a retirement that can commit now does so in milliseconds.
    retiring.join(3)
    retired_while_signing = not retiring.is_alive()
    release.set()
    publishing.join(60)
    retiring.join(60)
    assert answers[0].status_code == 201, answers[0].text
    assert retired and retired[0][0] is True

    with live.client() as client:
        jwks = client.get("/v1/keys").json()
    assert signing_now not in {key["kid"] for key in jwks["keys"]}
    expect = {
        "expect_key": pub.key,
        "expect_artifact": pub.artifact.digest,
        "expect_components": {"consts": pub.components["consts"].digest},
    }
    with live.client(token) as client:
        record = client.get(pub.path("acme", name)).json()
        again = client.put(pub.path("acme", name), json=pub.manifest)
        (hit,) = client.post("/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": [pub.key]}).json()[
            "answers"
        ]
    assert again.status_code == 200, again.text
    for receipt in (record["receipt"], again.json()["receipt"], hit["receipt"]):
        verify_receipt(receipt, jwks, **expect, expect_repo=f"acme/{name}")
    assert not retired_while_signing, "the retirement committed between a receipt's signature and its record"
