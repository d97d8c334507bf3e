"""Conformance: the service routes, names and authentication (docs/protocol.md "Service", "Names")."""

from __future__ import annotations

import pytest

from tests.conformance.conftest import unique


def test_health_ready_and_capabilities(deployment):
    with deployment.client() as client:
        assert client.get("/healthz").status_code == 200
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "ok"
        caps = client.get("/v1/capabilities").json()
    assert caps["digest_algorithms"] == ["blake3"]
    assert caps["key_schemes"] == ["ck1"]
    assert "torch-inductor-cache" in caps["retired_kinds"]


def test_no_token_is_401_with_a_bearer_challenge(deployment):
    with deployment.client() as client:
        answer = client.get(f"/v1/repos/{unique('conf')}/r/blobs/blake3:{'0' * 64}")
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "UNAUTHORIZED"
    assert answer.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize("token", ["garbage", "a.b.c", "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4In0."])
def test_a_bad_token_is_never_anonymous(deployment, token):
    with deployment.client(token) as client:
        answer = client.get(f"/v1/repos/{unique('conf')}/r/blobs/blake3:{'0' * 64}")
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "TOKEN_INVALID"


@pytest.mark.parametrize("owner", ["Acme", "acme_", "-acme", "ac%20me", "аcme"])
def test_invalid_names_are_400(deployment, owner):
    token = deployment.mint(unique("conf-names"), "*/*:read,write")
    with deployment.client(token) as client:
        answer = client.put(f"/v1/repos/{owner}/r/blobs/blake3:{'0' * 64}", content=b"")
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "NAME_INVALID"


def test_root_is_not_writable_by_a_tenant_wildcard(deployment):
    token = deployment.mint(unique("conf-tenant"), "*/*:read,write")
    with deployment.client(token) as client:
        answer = client.put(f"/v1/repos/root/{unique('r')}/blobs/blake3:{'0' * 64}", content=b"")
    assert answer.status_code == 403
    assert answer.json()["error"]["code"] == "ROOT_RESERVED"
