"""Audit, complete: every mutation over HTTP leaves exactly one entry, under its actor and jti (both configurations).

Read back through ``GET /v1/audit`` the way an admin would: by actor, by jti, by repo.
"""

from __future__ import annotations

import uuid

import blake3

from tests.support.live_store import unique_repo


def _blob(tag: str) -> tuple[bytes, str]:
    data = f"mutation {tag} {uuid.uuid4()}".encode()
    return data, "blake3:" + blake3.blake3(data).hexdigest()


def _entries(store, admin: str, **params) -> list[dict]:
    with store.client(admin) as client:
        answer = client.get("/v1/audit", params={"limit": 1000, **params})
    assert answer.status_code == 200, answer.text
    return answer.json()["entries"]


def test_every_mutation_is_audited_once(store, admin):
    owner, name, copy = f"o-{uuid.uuid4().hex[:10]}", unique_repo("mut"), unique_repo("mut-copy")
    sub = f"maker-{uuid.uuid4().hex[:8]}"
    maker = store.mint(sub, f"{owner}/*:read,write,owner:create")
    (one, one_digest), (two, two_digest) = _blob("one"), _blob("two")
    with store.client(maker) as client:
        assert client.post("/v1/owners", json={"slug": owner}).status_code == 201
        assert client.put(f"/v1/repos/{owner}/{name}", json={"visibility": "owner"}).status_code == 201
        assert client.put(f"/v1/repos/{owner}/{name}", json={"visibility": "principal"}).status_code == 200
        assert client.put(f"/v1/repos/{owner}/{name}/blobs/{one_digest}", content=one).status_code == 201
        location = client.post(f"/v1/repos/{owner}/{name}/uploads").headers["location"]
        assert client.patch(location, content=two, headers={"Content-Range": f"0-{len(two) - 1}"}).status_code == 202
        assert client.put(location, params={"digest": two_digest}).status_code == 201
        mounted = client.post(f"/v1/repos/{owner}/{copy}/blobs/{one_digest}:mount", params={"from": f"{owner}/{name}"})
        assert mounted.status_code == 201
        child = client.post(
            "/v1/tokens/attenuate", json={"grants": [{"repo": f"{owner}/{name}", "actions": ["read"]}], "ttl_s": 60}
        ).json()
    with store.client(admin) as client:
        minted = client.post("/v1/tokens", json={"sub": sub, "grants": [], "ttl_s": 60}).json()
        assert client.delete(f"/v1/tokens/{child['jti']}").status_code == 200

    made = _entries(store, admin, actor=sub)
    assert [(e["action"], e["target"], e["repo"], e["outcome"]) for e in made] == [
        ("owner.claim", owner, None, "ok"),
        ("repo.create", f"{owner}/{name}", f"{owner}/{name}", "ok"),
        ("repo.visibility", f"{owner}/{name}", f"{owner}/{name}", "ok"),
        ("blob.upload", f"{owner}/{name}@{one_digest}", f"{owner}/{name}", "ok"),
        ("blob.upload", f"{owner}/{name}@{two_digest}", f"{owner}/{name}", "ok"),
        ("repo.create", f"{owner}/{copy}", f"{owner}/{copy}", "ok"),  # the mount's first write creates it
        ("blob.mount", f"{owner}/{copy}@{one_digest}", f"{owner}/{copy}", "ok"),
        ("token.attenuate", child["jti"], None, "ok"),
    ]
    maker_jti = made[0]["jti"]
    assert maker_jti and all(e["jti"] == maker_jti for e in made)
    assert _entries(store, admin, jti=maker_jti) == made
    assert made[4]["detail"]["session"]  # the resumable commit names its session

    admin_jti = store.context.tokens.verify(admin).jti
    by_admin = [e for e in _entries(store, admin, jti=admin_jti) if e["target"] in (minted["jti"], child["jti"])]
    assert [(e["action"], e["target"]) for e in by_admin] == [
        ("token.mint", minted["jti"]),
        ("token.revoke", child["jti"]),
    ]
    assert by_admin[1]["detail"]["revoked"] == 1
