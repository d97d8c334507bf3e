"""Cap-token enforcement over HTTP: every /v1 route but capabilities authenticates (both configurations)."""

from __future__ import annotations

import time

import blake3
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cgstore.audit.models import AuditEvent
from cgstore.tokens.service import TokenService
from tests.support.audit import audited as support_audited
from tests.support.audit import flush_denials
from tests.support.live_store import unique_repo

DATA = b"cap-token protected bytes"
DIGEST = "blake3:" + blake3.blake3(DATA).hexdigest()


def code(response) -> str:
    return response.json()["error"]["code"]


def audited(store, outcome: str, target_part: str) -> list[AuditEvent]:
    return support_audited(store, outcome, target=target_part)


@pytest.fixture
def owned(store):
    name = unique_repo()
    writer = store.mint("alice", f"acme/{name}:read,write")
    with store.client(writer) as client:
        assert client.put(f"/v1/repos/acme/{name}/blobs/{DIGEST}", content=DATA).status_code == 201
    return name, writer


def test_capabilities_need_no_token(store):
    with store.client() as client:
        answer = client.get("/v1/capabilities")
    assert answer.status_code == 200
    body = answer.json()
    assert body["digest_algorithms"] == ["blake3"]
    assert body["retired_kinds"] == ["torch-inductor-cache"]
    assert body["max_resolve_keys"] == 256
    assert body["redirect_downloads"] is store.is_s3


def test_no_token_is_unauthorized_with_challenge(store, owned):
    name, _ = owned
    with store.client() as client:
        answer = client.head(f"/v1/repos/acme/{name}/blobs/{DIGEST}")
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"].startswith("Bearer")
        answer = client.post(f"/v1/repos/acme/{name}/uploads")
        assert answer.status_code == 401 and code(answer) == "UNAUTHORIZED"


@pytest.mark.parametrize("header", ["Bearer not-a-jwt", "Bearer", "Basic YWxpY2U6c2VjcmV0", "Bearer a.b.c"])
def test_malformed_token_is_token_invalid_never_anonymous(store, owned, header):
    name, _ = owned
    with store.client() as client:
        answer = client.get(f"/v1/repos/acme/{name}/blobs/{DIGEST}", headers={"Authorization": header})
    assert answer.status_code == 401 and code(answer) == "TOKEN_INVALID"


def test_forged_token_is_token_invalid_and_audited(store, owned):
    name, writer = owned
    claims = jwt.decode(writer, options={"verify_signature": False})
    header = jwt.get_unverified_header(writer)
    forged = jwt.encode(claims, Ed25519PrivateKey.generate(), algorithm="EdDSA", headers={"kid": header.get("kid")})
    flush_denials(store)  # so this 401 opens its own aggregate row
    with store.client(forged) as client:
        answer = client.get(f"/v1/repos/acme/{name}/blobs/{DIGEST}")
    assert answer.status_code == 401 and code(answer) == "TOKEN_INVALID"
    assert audited(store, "TOKEN_INVALID", name)


def test_expired_token_is_token_invalid(store, owned):
    name, _ = owned
    past = TokenService(
        store.context.db, store.settings, ring=store.context.tokens.ring, clock=lambda: time.time() - 7200
    )
    expired = past.mint("alice", [f"acme/{name}:read"], 3600).token
    with store.client(expired) as client:
        answer = client.head(f"/v1/repos/acme/{name}/blobs/{DIGEST}")
    assert answer.status_code == 401
    with store.client(expired) as client:
        assert code(client.get(f"/v1/repos/acme/{name}/blobs/{DIGEST}")) == "TOKEN_INVALID"


def test_revoked_token_is_token_invalid(store, owned):
    name, _ = owned
    minted = store.context.tokens.mint("alice", [f"acme/{name}:read"], 3600)
    store.context.tokens.revoke(minted.jti)
    with store.client(minted.token) as client:
        answer = client.get(f"/v1/repos/acme/{name}/blobs/{DIGEST}")
    assert answer.status_code == 401 and code(answer) == "TOKEN_INVALID"


def test_token_for_another_repo_reads_a_miss_and_cannot_write(store, owned):
    name, _ = owned
    elsewhere = store.mint("eve", f"acme/{unique_repo()}:read,write")
    with store.client(elsewhere) as client:
        read = client.get(f"/v1/repos/acme/{name}/blobs/{DIGEST}")
        absent = client.get(f"/v1/repos/acme/{name}/blobs/{'blake3:' + '0' * 64}")
        # Unreadable answers exactly like absent: same status, same body shape, same code.
        assert read.status_code == absent.status_code == 404
        assert code(read) == code(absent) == "BLOB_UNKNOWN"
        write = client.put(f"/v1/repos/acme/{name}/blobs/{DIGEST}", content=DATA)
        assert write.status_code == 403 and code(write) == "DENIED"
        session = client.post(f"/v1/repos/acme/{name}/uploads")
        assert session.status_code == 403 and code(session) == "DENIED"
    assert audited(store, "DENIED", name)
    assert audited(store, "BLOB_UNKNOWN", name)  # the hidden denial is audited, though it looks like a miss


def test_a_plain_miss_is_not_audited_as_a_denial(store, owned):
    name, writer = owned
    absent = "blake3:" + "1" * 64
    with store.client(writer) as client:
        assert client.get(f"/v1/repos/acme/{name}/blobs/{absent}").status_code == 404
    assert not audited(store, "BLOB_UNKNOWN", absent)


def test_read_only_token_cannot_write(store, owned):
    name, _ = owned
    reader = store.mint("rita", f"acme/{name}:read")
    with store.client(reader, follow_redirects=True) as client:
        assert client.get(f"/v1/repos/acme/{name}/blobs/{DIGEST}").content == DATA
        answer = client.put(f"/v1/repos/acme/{name}/blobs/{DIGEST}", content=DATA)
    assert answer.status_code == 403 and code(answer) == "DENIED"


@pytest.mark.parametrize("owner", ["Root", "rооt", "acme_corp", "-acme", "a" * 40, "ａcme"])
def test_invalid_owner_names(store, owner):
    token = store.mint("alice", "*/*:read,write")
    with store.client(token) as client:
        answer = client.put(f"/v1/repos/{owner}/models/blobs/{DIGEST}", content=DATA)
    assert answer.status_code == 400 and code(answer) == "NAME_INVALID"


@pytest.mark.parametrize("repo", ["Models", "-x", ".hidden", "a" * 101, "mоdels"])
def test_invalid_repo_names(store, repo):
    token = store.mint("alice", "acme/*:read,write")
    with store.client(token) as client:
        answer = client.put(f"/v1/repos/acme/{repo}/blobs/{DIGEST}", content=DATA)
    assert answer.status_code == 400 and code(answer) == "NAME_INVALID"


def test_root_needs_a_registered_platform_principal(store):
    name = unique_repo("family")
    wildcard = store.mint("tenant", "*/*:read,write")
    literal_no_plt = store.mint("tenant2", f"root/{name}:read,write")
    platform = store.mint("platform-ci", "root/*:read,write", platform=True)
    url = f"/v1/repos/root/{name}/blobs/{DIGEST}"
    for token in (wildcard, literal_no_plt):
        with store.client(token) as client:
            answer = client.put(url, content=DATA)
        assert answer.status_code == 403 and code(answer) == "ROOT_RESERVED"
    with store.client(platform) as client:
        assert client.put(url, content=DATA).status_code == 201
    # root repos are readable by every valid token
    with store.client(store.mint("anyone", "acme/x:read"), follow_redirects=True) as client:
        assert client.get(url).content == DATA
    assert audited(store, "ROOT_RESERVED", name)
