"""The token lifecycle, owners and repos over HTTP and the CLI (both configurations)."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import uuid

from sqlalchemy import select

from cgstore.audit.models import AuditEvent
from cgstore.repos.service import find_repo
from cgstore.tokens.models import TokenRecord
from cgstore_client.wire.tokens import MAX_TOKEN_PAGE
from tests.support.live_store import unique_repo

CGSTORE = [sys.executable, "-m", "cgstore.cli"]


def code(response) -> str:
    return response.json()["error"]["code"]


def audit_actions(store, target: str) -> list[str]:
    with store.context.db.session() as session:
        rows = session.scalars(select(AuditEvent).where(AuditEvent.target == target).order_by(AuditEvent.id))
        return [row.action for row in rows]


def cli(store, *args: str) -> str:
    env = {**os.environ, "CGSTORE_HOME": str(store.settings.home)}
    if store.settings.database_url:
        env["CGSTORE_DATABASE_URL"] = store.settings.database_url
    done = subprocess.run([*CGSTORE, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def grant(repo: str, *actions: str) -> dict:
    return {"repo": repo, "actions": list(actions)}


# -- tokens ----------------------------------------------------------------------------


def test_mint_needs_a_store_admin(store):
    body = {"sub": "bob", "grants": [grant("acme/x", "read")], "ttl_s": 60}
    for token in (store.mint("t", "acme/*:read,write,admin"), store.mint("t", "*/*:read,write")):
        with store.client(token) as client:
            answer = client.post("/v1/tokens", json=body)
        assert answer.status_code == 403 and code(answer) == "DENIED"
    with store.client(store.mint("ops", "*/*:admin")) as client:
        answer = client.post("/v1/tokens", json=body)
        assert answer.status_code == 201
        minted = answer.json()
        assert set(minted) == {"token", "jti", "exp"}
        assert audit_actions(store, minted["jti"]) == ["token.mint"]
        for bad in ({**body, "ttl_s": 0}, {**body, "grants": [grant("acme/[x]", "read")]}, {**body, "extra": 1}):
            assert client.post("/v1/tokens", json=bad).status_code == 400


def test_list_shows_claims_and_status_never_the_token(store):
    sub = f"lister-{uuid.uuid4().hex[:6]}"
    admin = store.mint("ops", "*/*:admin")
    with store.client(admin) as client:
        minted = client.post("/v1/tokens", json={"sub": sub, "grants": [grant("acme/x", "read")], "ttl_s": 600}).json()
        listing = client.get("/v1/tokens", params={"sub": sub})
    assert listing.status_code == 200
    assert minted["token"].rsplit(".", 1)[1] not in listing.text and 'token"' not in listing.text
    (row,) = listing.json()["tokens"]
    assert row["jti"] == minted["jti"] and row["sub"] == sub and row["status"] == "active"
    assert row["parent"] is None and row["grants"] == [grant("acme/x", "read")]
    with store.client(store.mint("t", "acme/*:read")) as client:
        assert client.get("/v1/tokens").status_code == 403


def list_pages(client, **params) -> list[dict]:
    """Every page of ``GET /v1/tokens``, following ``next_cursor``."""
    pages, cursor = [], None
    while True:
        answer = client.get("/v1/tokens", params={**params, **({"cursor": cursor} if cursor else {})})
        assert answer.status_code == 200, answer.text
        pages.append(answer.json())
        if pages[-1]["next_cursor"] is None:
            return pages
        cursor = pages[-1]["next_cursor"]


def test_the_token_listing_pages_by_keyset(store):
    """Issue 15 §6: more tokens than a page holds, each listed exactly once, oldest first (both filters)."""
    sub = f"pager-{uuid.uuid4().hex[:6]}"
    minted = [store.context.tokens.mint(sub, ["acme/x:read"], 600).jti for _ in range(7)]
    with store.client(store.mint("ops", "*/*:admin")) as client:
        pages = list_pages(client, sub=sub, limit=3)
        everyone = [t["jti"] for page in list_pages(client, limit=4) for t in page["tokens"]]
    assert [len(page["tokens"]) for page in pages] == [3, 3, 1]
    listed = [t["jti"] for page in pages for t in page["tokens"]]
    # Minted within the same second: the jti orders tokens issued at the same time.
    assert sorted(listed) == sorted(minted) and len(set(listed)) == len(listed)
    issued = [t["issued_at"] for page in pages for t in page["tokens"]]
    assert issued == sorted(issued)
    assert len(set(everyone)) == len(everyone) and set(minted) <= set(everyone)


def test_a_bad_token_cursor_or_limit_is_refused(store):
    with store.client(store.mint("ops", "*/*:admin")) as client:
        for params in (
            {"cursor": "f" * 32},
            {"cursor": "not-a-jti"},
            {"cursor": "f" * 65},
            {"limit": 0},
            {"limit": 1001},
            {"limit": "many"},
        ):
            answer = client.get("/v1/tokens", params=params)
            assert answer.status_code == 400 and code(answer) == "BAD_REQUEST", (params, answer.text)


def test_cli_lists_every_page(store):
    """``cgstore token list`` follows the pages: more tokens than the largest page, each printed once."""
    sub = f"many-{uuid.uuid4().hex[:6]}"
    issued = dt.datetime.now(dt.UTC).replace(microsecond=0)
    rows = [
        TokenRecord(
            jti=f"{sub.replace('-', '')}{n:06d}",
            sub=sub,
            grants=[],
            issued_at=issued,
            expires_at=issued + dt.timedelta(hours=1),
        )
        for n in range(MAX_TOKEN_PAGE + 1)
    ]
    with store.context.db.session() as session:
        session.add_all(rows)
    listed = [line.split()[0] for line in cli(store, "token", "list", "--sub", sub).splitlines()]
    assert sorted(listed) == sorted(row.jti for row in rows)


def test_revoke_cascades_to_every_descendant(store):
    name = unique_repo()
    root = store.context.tokens.mint("job", [f"acme/{name}:read,write"], 600)
    with store.client(root.token) as client:
        child = client.post(
            "/v1/tokens/attenuate", json={"grants": [grant(f"acme/{name}", "write")], "ttl_s": 300}
        ).json()
    with store.client(child["token"]) as client:
        grandchild = client.post(
            "/v1/tokens/attenuate", json={"grants": [grant(f"acme/{name}", "read")], "ttl_s": 60}
        ).json()
    admin = store.mint("ops", "*/*:admin")
    with store.client(admin) as client:
        assert client.delete(f"/v1/tokens/{root.jti}").json() == {"revoked": 3}
        assert client.delete(f"/v1/tokens/{root.jti}").json() == {"revoked": 0}
        assert client.delete(f"/v1/tokens/{'f' * 32}").status_code == 404
        statuses = {t["jti"]: t["status"] for t in client.get("/v1/tokens", params={"sub": "job"}).json()["tokens"]}
    assert statuses[root.jti] == statuses[child["jti"]] == statuses[grandchild["jti"]] == "revoked"
    for token in (root.token, child["token"], grandchild["token"]):
        with store.client(token) as client:
            assert client.post(f"/v1/repos/acme/{name}/preflight").status_code == 401
    assert audit_actions(store, root.jti)[-2:] == ["token.revoke", "token.revoke"]


def test_cli_lists_and_revokes(store):
    sub = f"cli-{uuid.uuid4().hex[:6]}"
    minted = store.context.tokens.mint(sub, ["acme/x:read"], 600)
    listing = cli(store, "token", "list", "--sub", sub)
    assert minted.jti in listing and "active" in listing and minted.token not in listing
    assert cli(store, "token", "revoke", minted.jti).strip() == "revoked 1 tokens"
    assert "revoked" in cli(store, "token", "list", "--sub", sub)


def test_jwks_needs_no_token(store):
    with store.client() as client:
        answer = client.get("/v1/keys")
    assert answer.status_code == 200
    assert all(key["kty"] == "OKP" and "d" not in key for key in answer.json()["keys"])


# -- owners and repos ---------------------------------------------------------------------


def test_claim_then_write_and_configure_own_repos(store):
    slug = f"team-{uuid.uuid4().hex[:8]}"
    tenant = store.mint(f"tenant-{slug}", "*/*:owner:create,read,write")
    with store.client(tenant) as client:
        claimed = client.post("/v1/owners", json={"slug": slug})
        assert claimed.status_code == 201
        assert claimed.json()["slug"] == slug and claimed.json()["principal"] == f"tenant-{slug}"
        created = client.put(f"/v1/repos/{slug}/cache", json={"visibility": "principal"})
        assert created.status_code == 201 and created.json()["visibility"] == "principal"
        changed = client.put(f"/v1/repos/{slug}/cache", json={"visibility": "owner"})
        assert changed.status_code == 200 and changed.json()["visibility"] == "owner"
        assert client.put(f"/v1/repos/{slug}/cache", json={"visibility": "public"}).status_code == 400
        assert client.post(f"/v1/repos/{slug}/other/uploads").status_code == 202
    assert audit_actions(store, slug) == ["owner.claim"]
    assert audit_actions(store, f"{slug}/cache") == ["repo.create", "repo.visibility"]
    # Another tenant, even with a wildcard grant, manages nothing there; an admin grant manages the
    # repo, but flipping its visibility is the owner's (or the platform's): tests/security/test_private_caches.py.
    with store.client(store.mint("intruder", "*/*:read,write")) as client:
        answer = client.put(f"/v1/repos/{slug}/cache", json={"visibility": "principal"})
        assert answer.status_code == 403 and code(answer) == "DENIED"
    with store.client(store.mint("ops", f"{slug}/*:admin")) as client:
        assert client.put(f"/v1/repos/{slug}/cache", json={"visibility": "owner"}).status_code == 200
        answer = client.put(f"/v1/repos/{slug}/cache", json={"visibility": "principal"})
        assert answer.status_code == 403 and code(answer) == "DENIED"
        assert client.put(f"/v1/repos/{slug}/fresh", json={"visibility": "principal"}).status_code == 201


def test_a_grant_naming_an_unclaimed_owner_literally_writes(store):
    name = unique_repo()
    with store.client(store.mint("ci", f"acme/{name}:write")) as client:
        assert client.post(f"/v1/repos/acme/{name}/uploads").status_code == 202
    with store.client(store.mint("wild", "*/*:write")) as client:
        answer = client.post(f"/v1/repos/acme/{unique_repo()}/uploads")
    assert answer.status_code == 403 and "not held" in answer.json()["error"]["message"]


def test_root_repos_are_configured_through_the_root_gate(store):
    name = unique_repo("family")
    with store.client(store.mint("tenant", "root/*:read,write,admin")) as client:
        answer = client.put(f"/v1/repos/root/{name}", json={"visibility": "owner"})
    assert answer.status_code == 403 and code(answer) == "ROOT_RESERVED"
    with store.client(store.mint("platform-ci", f"root/{name}:write", platform=True)) as client:
        assert client.put(f"/v1/repos/root/{name}", json={"visibility": "owner"}).status_code == 201
    with store.context.db.session() as session:
        assert find_repo(session, "root", name).created_by == "platform-ci"


def test_cli_demotes_a_platform_principal_and_root_writes_stop(store):
    name = unique_repo("family")
    sub = f"plat-{uuid.uuid4().hex[:6]}"
    token = store.mint(sub, f"root/{name}:write", platform=True)
    with store.client(token) as client:
        assert client.post(f"/v1/repos/root/{name}/preflight").status_code == 204
        assert cli(store, "principal", "set", sub, "--tenant").strip() == f"{sub}: tenant"
        answer = client.post(f"/v1/repos/root/{name}/preflight")
    assert answer.status_code == 403 and answer.json()["error"]["detail"]["missing"] == [
        "a registered platform principal"
    ]
    assert audit_actions(store, sub) == ["principal.register"]
