"""A hostile upstream (a proxy in front of the honest one that alters what passes) gets nothing stored or served,
and a worker pinning the upstream's keys refuses what a compromised mirror serves (issue 27 §1 "Client", §2).

The tests run in order on one mirror: a blob byte altered, a JWKS listing a key
no trusted key vouches for (refused, alarmed), receipts swapped, then a genuine
rotation announced under a trusted key (adopted, the alarm cleared).
"""

from __future__ import annotations

import contextlib
import json

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select, update

from cgstore.audit.models import AuditEvent
from cgstore.blobs.models import Blob
from cgstore.compiled_graphs.models import CompiledGraph
from cgstore.mirror import service as mirror_service
from cgstore.mirror import trust
from cgstore.mirror.models import REFUSED_KEYS, MirrorState
from cgstore.tokens.ring import jwk, key_id
from cgstore_client.receipts import RECEIPT_TYP, ReceiptInvalid, verify_jws_receipt
from cgstore_client.worker.client import Client
from cgstore_client.worker.outcomes import RECEIPT_INVALID, Eager
from tests.mirror.support import MIRROR_FAMILY, OWNER, HostileProxy, resolve, serving, start_mirror
from tests.support.live_store import unique_repo


@pytest.fixture(scope="module")
def hostile(upstream):
    proxy = HostileProxy(upstream.base_url)
    with serving(proxy, "hostile-upstream") as (url, _):
        proxy.url = url
        yield proxy


@pytest.fixture(scope="module")
def victim(hostile, request, tmp_path_factory, upstream):
    """An embedded mirror whose upstream is the hostile proxy (it trusts the honest upstream's keys)."""
    with contextlib.ExitStack() as stack:
        yield start_mirror(stack, request, tmp_path_factory, upstream, "embedded", via=hostile.url)


@pytest.fixture(autouse=True)
def honest_again(hostile):
    yield
    hostile.alter = lambda path, body: body


def _nothing_stored(mirror, key: str, digest: str | None = None) -> None:
    with mirror.live.context.db.session() as session:
        assert session.scalar(select(CompiledGraph.id).where(CompiledGraph.key == key)) is None
        if digest is not None:
            assert session.get(Blob, digest) is None
    if digest is not None:
        assert mirror.live.context.storage.size(digest) is None


def _refusals(mirror, key: str) -> list[dict]:
    with mirror.live.context.db.session() as session:
        rows = session.scalars(
            select(AuditEvent).where(AuditEvent.action == "mirror.pull", AuditEvent.target.endswith(key))
        ).all()
        return [row.detail for row in rows if row.outcome == "refused"]


def _resign(receipt: str, key: Ed25519PrivateKey, **changes) -> str:
    claims = {**jwt.decode(receipt, options={"verify_signature": False}), **changes}
    return jwt.encode(claims, key, algorithm="EdDSA", headers={"kid": key_id(key.public_key()), "typ": RECEIPT_TYP})


def _record_path(repo: str, key: str) -> str:
    return f"/v1/repos/{OWNER}/{repo}/compiled-graphs/{key}"


def test_a_blob_byte_altered_in_transit_is_refused(upstream, hostile, victim):
    repo = unique_repo("flip")
    pub = upstream.publish(repo)

    def flip(path: str, body: bytes) -> bytes:
        if path.endswith(f"/blobs/{pub.artifact.digest}") and body:
            middle = len(body) // 2
            return body[:middle] + bytes([body[middle] ^ 1]) + body[middle + 1 :]
        return body

    hostile.alter = flip
    with victim.live.client(victim.worker) as client:
        assert resolve(client, pub.key) == {"key": pub.key, "status": "miss"}
        assert client.get(pub.path(OWNER, repo)).status_code == 404
    _nothing_stored(victim, pub.key, pub.artifact.digest)
    assert any("does not match its digest" in r["reason"] for r in _refusals(victim, pub.key))
    assert "cgstore_mirror_pulls_refused_total 0.0" not in victim.live.scrape_metrics()


def test_a_jwks_with_a_new_key_is_refused_and_alarmed(upstream, hostile, victim, monkeypatch):
    monkeypatch.setattr(mirror_service, "ROTATION_CHECK_S", 0.0)
    repo = unique_repo("jwks")
    pub = upstream.publish(repo)
    forger = Ed25519PrivateKey.generate()
    forged_key = jwk(key_id(forger.public_key()), forger.public_key())
    trusted_before = trust.fingerprint(upstream.jwks())

    def forge(path: str, body: bytes) -> bytes:
        if path == "/v1/keys":
            return json.dumps({"keys": [*json.loads(body)["keys"], forged_key]}).encode()
        if path == _record_path(repo, pub.key):
            record = json.loads(body)
            return json.dumps({**record, "receipt": _resign(record["receipt"], forger)}).encode()
        return body

    hostile.alter = forge
    with victim.live.client(victim.worker) as client:
        assert resolve(client, pub.key)["status"] == "miss"
    _nothing_stored(victim, pub.key)
    health = httpx.get(f"{victim.base_url}/healthz").json()
    assert health["status"] == "degraded" and "no trusted key vouches for" in health["mirror"]["alarm"]
    assert health["mirror"]["trusted_fingerprint"] == trusted_before  # not adopted
    with victim.live.context.db.session() as session:
        refused = session.get(MirrorState, REFUSED_KEYS).value
    assert forged_key["kid"] in {k["kid"] for k in refused["keys"]}
    assert forged_key["kid"] not in {k["kid"] for k in httpx.get(f"{victim.base_url}/v1/keys").json()["keys"]}


def test_a_swapped_receipt_is_refused(upstream, hostile, victim):
    repo = unique_repo("swap")
    first, second = upstream.publish(repo), upstream.publish(repo)
    with upstream.live.client(upstream.publisher) as client:
        first_receipt = client.get(first.path(OWNER, repo)).json()["receipt"]
    outsider = Ed25519PrivateKey.generate()

    def swap(path: str, body: bytes) -> bytes:
        if path == _record_path(repo, second.key):  # the upstream's genuine receipt, of another record
            return json.dumps({**json.loads(body), "receipt": first_receipt}).encode()
        if path == _record_path(repo, first.key):  # the same claims, signed by a key nobody trusts
            return json.dumps({**json.loads(body), "receipt": _resign(first_receipt, outsider)}).encode()
        return body

    hostile.alter = swap
    with victim.live.client(victim.worker) as client:
        assert resolve(client, second.key)["status"] == "miss"
        assert resolve(client, first.key)["status"] == "miss"
    _nothing_stored(victim, second.key)
    _nothing_stored(victim, first.key)
    assert any("receipt vouches for" in r["reason"] for r in _refusals(victim, second.key))
    assert _refusals(victim, first.key)


def test_a_rotation_announced_under_a_trusted_key_is_followed(upstream, victim, monkeypatch):
    monkeypatch.setattr(mirror_service, "ROTATION_CHECK_S", 0.0)
    ctx = upstream.live.context
    with ctx.db.session() as session:
        new_kid = ctx.tokens.ring.rotate(session)
    repo = unique_repo("rotated")
    pub = upstream.publish(repo)  # its receipt is signed by the new key
    with victim.live.client(victim.worker) as client:
        assert resolve(client, pub.key)["status"] == "hit"
    health = httpx.get(f"{victim.base_url}/healthz").json()
    assert health["status"] == "ok" and health["mirror"]["alarm"] is None
    assert health["mirror"]["trusted_fingerprint"] == trust.fingerprint(upstream.jwks())
    assert new_kid in {k["kid"] for k in trust.trusted_keys(victim.live.context.db)}


def test_a_worker_pinning_the_upstream_keys_refuses_what_a_compromised_mirror_serves(upstream, victim, tmp_path):
    repo = unique_repo("rogue")
    pub = upstream.publish(repo)
    with victim.live.client(victim.worker) as client:
        assert resolve(client, pub.key)["status"] == "hit"
    # The mirror turns rogue: it re-signs the record's receipt with its own key (which its /v1/keys lists).
    ctx = victim.live.context
    with ctx.db.session() as session:
        row = session.scalars(select(CompiledGraph).where(CompiledGraph.key == pub.key)).one()
        _, own_key = ctx.tokens.ring.signing_key(session)
        rogue = _resign(row.receipt, own_key, artifact=row.artifact_digest)
        session.execute(update(CompiledGraph).where(CompiledGraph.id == row.id).values(receipt=rogue))
    upstream_keys = upstream.jwks()
    with Client(victim.base_url, victim.worker, cache_dir=tmp_path / "pinned", trusted_jwks=upstream_keys) as pinned:
        (hit,) = pinned.resolve(MIRROR_FAMILY, [pub.key])
        with pytest.raises(ReceiptInvalid):
            verify_jws_receipt(hit, hit["receipt"], pinned.jwks())
        (refused,) = pinned.load(MIRROR_FAMILY, [pub.key])
        assert isinstance(refused, Eager) and refused.reason.startswith(RECEIPT_INVALID)
    # Without the pin, a worker trusts whatever keys the mirror lists: the pin is what protects it.
    with Client(victim.base_url, victim.worker, cache_dir=tmp_path / "unpinned") as unpinned:
        (hit,) = unpinned.resolve(MIRROR_FAMILY, [pub.key])
        verify_jws_receipt(hit, hit["receipt"], unpinned.jwks())
