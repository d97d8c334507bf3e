"""Signed publish receipts, verified the way a worker would: ``GET /v1/keys`` and PyJWT, nothing else.

This module imports nothing of the server: it talks to the running ``store``
over HTTP (both configurations), rotates the key ring through the operator's
CLI in a subprocess, and verifies receipts with PyJWT directly and with the
client package's ``verify_receipt``. Retiring a key re-signs its receipts.
A root record's receipt carries ``"plt": true``, which ``Want(root_only=True)``
requires; a receipt never vouches for another repo than the entry's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jwt
import pytest

from cgstore_client import Client, Want
from cgstore_client.receipts import RECEIPT_AUDIENCE, RECEIPT_TYP, ReceiptInvalid, verify_receipt
from cgstore_client.worker.outcomes import Eager, Loaded
from tests.compiled_graphs.support import CONSTANTS_A, FAMILY, publication, publish, safetensors_bytes
from tests.support.archives import archive_report
from tests.support.live_store import unique_repo
from tests.support.services import free_port

CONSTANTS = safetensors_bytes(CONSTANTS_A)


def jwks(store) -> dict:
    with store.client() as client:  # no token: the JWKS is public
        answer = client.get("/v1/keys")
    assert answer.status_code == 200, answer.text
    return answer.json()


def offline_claims(receipt: str, keys: dict, issuer: str) -> dict:
    """PyJWT alone: pick the JWK by kid, check typ, signature, aud and iss."""
    header = jwt.get_unverified_header(receipt)
    assert header["typ"] == RECEIPT_TYP and header["alg"] == "EdDSA"
    (jwk,) = [k for k in keys["keys"] if k["kid"] == header["kid"]]
    return jwt.decode(receipt, jwt.PyJWK(jwk).key, algorithms=["EdDSA"], audience=RECEIPT_AUDIENCE, issuer=issuer)


def cli(live, *args: str) -> str:
    """The operator's CLI against the running store's home and database (a subprocess): its output."""
    env = {**os.environ, "CGSTORE_HOME": str(live.settings.home)}
    if live.settings.database_url:
        env["CGSTORE_DATABASE_URL"] = live.settings.database_url
    done = subprocess.run(
        [sys.executable, "-m", "cgstore.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def tenant(store):
    name = unique_repo("rcpt")
    return name, store.mint("minter", f"acme/{name}:read,write")


def test_a_publish_receipt_verifies_offline_against_the_jwks(store, tenant, pt2_archive):
    name, token = tenant
    report = archive_report(pt2_archive)
    pub = publication(pt2_archive, report, components={"consts": CONSTANTS})
    with store.client(token) as client:
        created = publish(client, "acme", name, pub)
    assert created.status_code == 201, created.text
    receipt = created.json()["receipt"]

    claims = offline_claims(receipt, jwks(store), store.settings.token_issuer)
    assert claims == {
        "iss": store.settings.token_issuer,
        "aud": RECEIPT_AUDIENCE,
        "iat": claims["iat"],
        "repo": f"acme/{name}",
        "key": pub.key,
        "artifact": pub.artifact.digest,
        "components": {"consts": pub.components["consts"].digest},
        "graph": report.graph_digest,
        "publisher": "minter",
    }
    assert abs(claims["iat"] - time.time()) < 120
    assert (
        verify_receipt(
            receipt,
            jwks(store),
            expect_key=pub.key,
            expect_artifact=pub.artifact.digest,
            expect_components={"consts": pub.components["consts"].digest},
            expect_issuer=store.settings.token_issuer,
            expect_repo=f"acme/{name}",
        )
        == claims
    )


def test_re_publish_resolve_and_get_answer_the_same_receipt(store, tenant, pt2_archive):
    name, token = tenant
    pub = publication(pt2_archive, archive_report(pt2_archive), components={"consts": CONSTANTS})
    with store.client(token) as client:
        first = publish(client, "acme", name, pub)
        again = client.put(pub.path("acme", name), json=pub.manifest)
        resolved = client.post("/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": [pub.key]})
        record = client.get(pub.path("acme", name))
    assert (first.status_code, again.status_code) == (201, 200), again.text
    receipt = first.json()["receipt"]
    assert again.json()["receipt"] == receipt
    (hit,) = resolved.json()["answers"]
    assert hit["status"] == "hit" and hit["receipt"] == receipt
    assert record.json()["receipt"] == receipt
    # What the worker caches from the hit is exactly what the receipt vouches for.
    verify_receipt(
        hit["receipt"],
        jwks(store),
        expect_key=hit["key"],
        expect_artifact=hit["artifact"]["digest"],
        expect_components={c["name"]: c["digest"] for c in hit["components"]},
    )


def test_a_receipt_vouches_for_nothing_else(store, tenant, pt2_archive):
    name, token = tenant
    pub = publication(pt2_archive, archive_report(pt2_archive), components={"consts": CONSTANTS})
    with store.client(token) as client:
        receipt = publish(client, "acme", name, pub).json()["receipt"]
    keys = jwks(store)
    expect = {
        "expect_key": pub.key,
        "expect_artifact": pub.artifact.digest,
        "expect_components": {"consts": pub.components["consts"].digest},
    }
    with pytest.raises(ReceiptInvalid, match="vouches for"):
        verify_receipt(receipt, keys, **{**expect, "expect_artifact": "blake3:" + "0" * 64})
    with pytest.raises(ReceiptInvalid, match="vouches for"):
        verify_receipt(receipt, keys, **{**expect, "expect_components": {}})
    with pytest.raises(ReceiptInvalid, match="vouches for"):
        verify_receipt(receipt, keys, **expect, expect_repo="acme/elsewhere")
    with pytest.raises(ReceiptInvalid, match="issuer"):
        verify_receipt(receipt, keys, **expect, expect_issuer="another-store")
    head, body, signature = receipt.split(".")
    other = publication(pt2_archive, archive_report(pt2_archive), envelope={"shapes": [[512, 512]], "text_len": 77})
    forged_body = jwt.utils.base64url_encode(
        jwt.utils.base64url_decode(body).replace(pub.key.encode(), other.key.encode())
    ).decode()
    with pytest.raises(ReceiptInvalid, match="does not verify"):
        verify_receipt(f"{head}.{forged_body}.{signature}", keys, **{**expect, "expect_key": other.key})
    with pytest.raises(ReceiptInvalid, match="unknown key"):
        verify_receipt(receipt, {"keys": []}, **expect)


def test_a_cap_token_is_never_accepted_as_a_receipt(store, tenant):
    """Signed by the same key ring, but its typ (and aud) say what it is."""
    _, token = tenant
    with pytest.raises(ReceiptInvalid, match="not a receipt"):
        verify_receipt(token, jwks(store), expect_key="ck1-" + "0" * 56, expect_artifact="blake3:" + "0" * 64)
    # PyJWT alone refuses it too, on its audience.
    with pytest.raises(jwt.InvalidAudienceError):
        kid = jwt.get_unverified_header(token)["kid"]
        (jwk,) = [k for k in jwks(store)["keys"] if k["kid"] == kid]
        jwt.decode(token, jwt.PyJWK(jwk).key, algorithms=["EdDSA"], audience=RECEIPT_AUDIENCE)


def test_a_receipt_still_verifies_after_key_rotation(store, tenant, pt2_archive):
    name, token = tenant
    report = archive_report(pt2_archive)
    before = publication(pt2_archive, report, components={"consts": CONSTANTS})
    after = publication(
        pt2_archive, report, components={"consts": CONSTANTS}, envelope={"shapes": [[768, 768]], "text_len": 256}
    )
    with store.client(token) as client:
        old = publish(client, "acme", name, before).json()["receipt"]
        new_kid = cli(store, "keys", "rotate")  # no restart: the running store signs with it from the next publish
        new = publish(client, "acme", name, after).json()["receipt"]
    old_kid = jwt.get_unverified_header(old)["kid"]
    assert jwt.get_unverified_header(new)["kid"] == new_kid != old_kid
    keys = jwks(store)
    assert {old_kid, new_kid} <= {k["kid"] for k in keys["keys"]}  # the old kid stays until retired
    for receipt, pub in ((old, before), (new, after)):
        assert offline_claims(receipt, keys, store.settings.token_issuer)["key"] == pub.key
        verify_receipt(
            receipt,
            keys,
            expect_key=pub.key,
            expect_artifact=pub.artifact.digest,
            expect_components={"consts": pub.components["consts"].digest},
        )


def test_retiring_a_key_re_signs_its_receipts(make_store, pt2_archive):
    """Its receipts would die with its kid: the retire re-signs them, and resolve answers the new ones.

    A store of its own (retiring the shared store's key would kill every other
    test's tokens), embedded: an extra production store shares the session's
    database but not its bucket, so the archive's bytes, already recorded by
    the shared store, would be missing from its storage.
    """
    live = make_store("embedded")
    name = unique_repo("rcpt-retire")
    token = live.mint("minter", f"acme/{name}:read,write")
    pub = publication(pt2_archive, archive_report(pt2_archive), components={"consts": CONSTANTS})
    with live.client(token) as client:
        published = publish(client, "acme", name, pub)
        assert published.status_code == 201, published.text
        old = published.json()["receipt"]
    old_kid = jwt.get_unverified_header(old)["kid"]
    new_kid = cli(live, "keys", "rotate")
    assert cli(live, "keys", "retire", old_kid) == f"retired {old_kid}"

    keys = jwks(live)
    assert old_kid not in {k["kid"] for k in keys["keys"]}
    expect = {
        "expect_key": pub.key,
        "expect_artifact": pub.artifact.digest,
        "expect_components": {"consts": pub.components["consts"].digest},
    }
    with pytest.raises(ReceiptInvalid, match="unknown key"):
        verify_receipt(old, keys, **expect)
    fresh = live.mint("minter", f"acme/{name}:read,write")  # the first token died with its key
    with live.client(fresh) as client:
        resolved = client.post("/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": [pub.key]})
        again = client.put(pub.path("acme", name), json=pub.manifest)
    (hit,) = resolved.json()["answers"]
    assert jwt.get_unverified_header(hit["receipt"])["kid"] == new_kid
    assert again.status_code == 200 and again.json()["receipt"] == hit["receipt"]
    claims = verify_receipt(hit["receipt"], keys, **expect, expect_issuer=live.settings.token_issuer)
    assert claims == jwt.decode(old, options={"verify_signature": False})  # the same facts, a new signature


def test_a_root_record_s_receipt_carries_the_platform_claim(store, pt2_archive):
    name = unique_repo("rcpt-root")
    platform = store.mint("ci", f"root/{name}:read,write", platform=True)
    pub = publication(
        pt2_archive,
        archive_report(pt2_archive),
        components={"consts": CONSTANTS},
        envelope={"shapes": [[96, 96]], "text_len": 3},
    )
    with store.client(platform) as client:
        created = publish(client, "root", name, pub)
    assert created.status_code == 201, created.text
    claims = offline_claims(created.json()["receipt"], jwks(store), store.settings.token_issuer)
    assert claims["plt"] is True and claims["repo"] == f"root/{name}" and claims["publisher"] == "ci"


def test_root_only_wants_serve_only_receipts_that_prove_root(store, pt2_archive, tmp_path):
    """A tenant's record is eager for ``root_only``; relabelled ``root/...`` its receipt no longer verifies."""
    tenant, platform_repo = unique_repo("rcpt-t"), unique_repo("rcpt-p")
    tenant_token = store.mint("tenant", f"acme/{tenant}:read,write")
    platform = store.mint("ci", f"root/{platform_repo}:read,write", platform=True)
    report = archive_report(pt2_archive)
    ours = publication(
        pt2_archive, report, components={"consts": CONSTANTS}, envelope={"shapes": [[80, 80]], "text_len": 5}
    )
    theirs = publication(
        pt2_archive, report, components={"consts": CONSTANTS}, envelope={"shapes": [[80, 80]], "text_len": 6}
    )
    with store.client(tenant_token) as client:
        assert publish(client, "acme", tenant, ours).status_code == 201
    with store.client(platform) as client:
        assert publish(client, "root", platform_repo, theirs).status_code == 201

    cache = tmp_path / "c"
    with Client(store.base_url, tenant_token, cache_dir=cache) as worker:
        tenant_only, root = worker.load(FAMILY, [Want(ours.key, root_only=True), Want(theirs.key, root_only=True)])
        (plain,) = worker.load(FAMILY, [Want(ours.key)])
    assert isinstance(tenant_only, Eager) and tenant_only.reason.startswith("not a root record"), tenant_only
    assert isinstance(root, Loaded) and root.repo == f"root/{platform_repo}", root
    assert isinstance(plain, Loaded) and plain.repo == f"acme/{tenant}", plain

    # The tenant's cached entry relabelled as root's: the receipt names the tenant's repo.
    entry_path = cache / "records" / f"{ours.key}.json"
    entry = json.loads(entry_path.read_text())
    entry_path.write_text(json.dumps({**entry, "repo": "root/models"}))
    with Client(f"http://127.0.0.1:{free_port()}", tenant_token, cache_dir=cache, offline=True) as offline:
        for want in (Want(ours.key), Want(ours.key, root_only=True)):
            (served,) = offline.load(FAMILY, [want])
            assert isinstance(served, Eager) and served.reason.startswith("receipt invalid"), served
            assert "vouches for" in served.reason
