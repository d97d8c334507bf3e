"""Helpers of the attack tests: forging tokens with real and foreign keys, and reading the audit.

Every attack test asserts two things: the refusal on the wire, and an audit row
recording it (``tests.support.audit.audited``). Both run on both configurations (``store``).
"""

from __future__ import annotations

import json
import time
import uuid

import jwt
import pytest

from tests.support.live_store import unique_repo


def code(response) -> str:
    return response.json()["error"]["code"]


def store_key(store):
    """(kid, private key) the running store signs with now."""
    with store.context.db.session() as session:
        return store.context.tokens.ring.signing_key(session)


def payload(store, **over) -> dict:
    now = int(time.time())
    claims = {
        "iss": store.settings.token_issuer,
        "aud": "cgstore",
        "sub": "mallory",
        "iat": now,
        "exp": now + 600,
        "jti": uuid.uuid4().hex,
        "plt": False,
        "grants": [{"repo": "*/*", "actions": ["read", "write"]}],
    }
    claims.update(over)
    return claims


def sign(claims: dict, key, **headers) -> str:
    return jwt.encode(claims, key, algorithm="EdDSA", headers=headers)


def decode_unverified(token: str) -> dict:
    return jwt.decode(token, options={"verify_signature": False})


def b64(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64json(doc: dict) -> str:
    return b64(json.dumps(doc).encode())


@pytest.fixture
def target(store):
    """A repo the attack aims at, with one blob a victim wrote, and the victim's token."""
    import blake3

    name = unique_repo("sec")
    data = f"victim bytes {name}".encode()
    digest = "blake3:" + blake3.blake3(data).hexdigest()
    victim = store.mint("victim", f"acme/{name}:read,write")
    with store.client(victim) as client:
        assert client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data).status_code == 201
    return {"name": name, "digest": digest, "url": f"/v1/repos/acme/{name}/blobs/{digest}", "victim": victim}
