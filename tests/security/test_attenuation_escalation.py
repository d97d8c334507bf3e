"""A child token never does what its parent cannot: wildcard owners through attenuation, and the chain depth.

A wildcard owner (``*``, ``team-*``) writes only under the holder's own owners,
while a grant naming an owner literally writes under it whoever holds it. So a
child naming ``victim`` literally, attenuated from ``*/*:write``, would be a
write the parent never had (issue 15, section 1): it is refused as any wider
child is (403 ``DENIED``), unless the principal holds that owner. Over HTTP on
both configurations (``store``), plus a property test of the pure rule over
every access decision, and the depth limit (a child the store would not verify
is refused with 400, not minted).
"""

from __future__ import annotations

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgstore import access
from cgstore.tokens.claims import Claims
from cgstore.tokens.grants import ACTIONS, ADMIN, OWNER_CREATE, READ, WRITE, Grant, is_subset
from cgstore.tokens.service import MAX_CHAIN_DEPTH
from tests.security.conftest import code
from tests.support.audit import audited
from tests.support.live_store import unique_repo

DATA = b"bytes a tenant tries to plant in another tenant's owner"
DIGEST = "blake3:" + blake3.blake3(DATA).hexdigest()


def attenuate(store, token: str, grants: list[str], ttl_s: int = 500):
    body = {"grants": [_json_grant(g) for g in grants], "ttl_s": ttl_s}
    with store.client(token) as client:
        return client.post("/v1/tokens/attenuate", json=body)


def _json_grant(cli: str) -> dict:
    pattern, _, actions = cli.partition(":")
    return {"repo": pattern, "actions": actions.split(",")}


def claim(store, sub: str, slug: str) -> None:
    with store.client(store.mint(sub, f"{slug}/*:owner:create")) as client:
        assert client.post("/v1/owners", json={"slug": slug}).status_code == 201


def writes(store, token: str, owner: str, repo: str) -> tuple[int, int]:
    """(preflight status, blob upload status) of ``token`` in ``owner/repo``."""
    with store.client(token) as client:
        early = client.post(f"/v1/repos/{owner}/{repo}/preflight").status_code
        upload = client.put(f"/v1/repos/{owner}/{repo}/blobs/{DIGEST}", content=DATA).status_code
    return early, upload


@pytest.fixture
def victim(store):
    """An owner held by another tenant, with that tenant's name."""
    slug = unique_repo("victim")
    claim(store, "victim-tenant", slug)
    return slug


@pytest.mark.parametrize(
    ("parent_grants", "child_grant"),
    [
        (["*/*:read,write,owner:create"], "{victim}/*:read,write"),
        (["*/*:read,write,owner:create"], "{victim}/models:write"),
        (["team-*/*:write"], "{victim}/*:write"),
        (["*/*:admin"], "{victim}/*:admin"),
    ],
    ids=["star-owner", "star-owner-one-repo", "team-glob", "admin"],
)
def test_a_literal_owner_the_parent_only_covers_by_wildcard_is_wider(store, parent_grants, child_grant):
    slug = unique_repo("team")  # matches team-* as well as *
    claim(store, "victim-tenant", slug)
    parent_claims = store.context.tokens.mint("mallory", parent_grants, 600)
    # The parent itself is refused: its wildcard reaches only mallory's own owners.
    assert writes(store, parent_claims.token, slug, "models") == (403, 403)

    grant = child_grant.format(victim=slug)
    answer = attenuate(store, parent_claims.token, [grant])
    assert answer.status_code == 403, answer.text
    assert code(answer) == "DENIED"
    assert any(grant.split(":")[0] in part for part in answer.json()["error"]["detail"]["wider"])
    assert audited(store, "DENIED", jti=parent_claims.jti)


def test_an_unclaimed_owner_is_not_covered_either(store):
    """Nobody holds it now; a literal grant would keep writing there once someone claims it."""
    slug = unique_repo("free")
    parent = store.mint("mallory", "*/*:read,write,owner:create")
    assert attenuate(store, parent, [f"{slug}/*:read,write"]).status_code == 403


def test_reading_a_literal_owner_under_a_wildcard_stays_narrowable(store, victim):
    """``read`` through ``*`` reaches every owner already: naming one is narrower, not wider."""
    parent = store.mint("mallory", "*/*:read,write,owner:create")
    assert attenuate(store, parent, [f"{victim}/*:read"]).status_code == 201


def test_a_held_owner_is_covered_and_the_child_writes_there(store, victim):
    own = unique_repo("own")
    claim(store, "mallory", own)
    parent = store.mint("mallory", "*/*:read,write,owner:create")
    answer = attenuate(store, parent, [f"{own}/*:read,write"])
    assert answer.status_code == 201, answer.text
    child = answer.json()["token"]
    assert writes(store, child, own, "models") == (204, 201)
    assert writes(store, child, victim, "models") == (403, 403)


# -- depth ------------------------------------------------------------------------------------------


def test_a_child_beyond_the_chain_depth_is_refused_with_the_limit_named(store):
    name = unique_repo()
    token = store.mint("deep", f"acme/{name}:read,write")
    for depth in range(1, MAX_CHAIN_DEPTH):  # the root token plus these: MAX_CHAIN_DEPTH tokens
        # Each child lives a little shorter than its parent, so only the depth can make one wider.
        answer = attenuate(store, token, [_grant_of(token)], ttl_s=3600 - 10 * depth)
        assert answer.status_code == 201, answer.text
        token = answer.json()["token"]
    with store.client(token) as client:  # the deepest child the store mints, it also honours
        assert client.post(f"/v1/repos/acme/{name}/preflight").status_code == 204

    answer = attenuate(store, token, [_grant_of(token)], ttl_s=600)
    assert answer.status_code == 400, answer.text
    assert code(answer) == "BAD_REQUEST"
    assert str(MAX_CHAIN_DEPTH) in answer.json()["error"]["message"]
    assert answer.json()["error"]["detail"]["max_chain_depth"] == MAX_CHAIN_DEPTH


def _grant_of(token: str) -> str:
    from tests.security.conftest import decode_unverified

    grant = decode_unverified(token)["grants"][0]
    return f"{grant['repo']}:{','.join(grant['actions'])}"


# -- the rule as a property -----------------------------------------------------------------------

SUB = "mallory"
OWNERS = ("acme", "team-a", "team-b", "victim", "root")
REPOS = ("models", "m1", "x")
owner_patterns = st.sampled_from(OWNERS + ("*", "team-*", "t*", "?cme"))
repo_patterns = st.sampled_from(REPOS + ("*", "m*"))
grants = st.builds(Grant, owner_patterns, repo_patterns, st.frozensets(st.sampled_from(sorted(ACTIONS)), min_size=1))
grant_sets = st.lists(grants, min_size=1, max_size=4).map(tuple)
holders = st.fixed_dictionaries({o: st.sampled_from((None, SUB, "victim-tenant")) for o in OWNERS[:-1]})


def _claims(grant_set: tuple[Grant, ...], plt: bool) -> Claims:
    return Claims(iss="i", aud="cgstore", sub=SUB, iat=0, exp=100, jti="j", plt=plt, grants=grant_set)


def _allowed(claims: Claims, owner: str, repo: str, holder: str | None) -> set[str]:
    """Every decision access makes for ``claims`` on ``owner/repo``, as the names of those it allows."""
    decisions = {
        READ: access.can_read(claims, owner, repo),
        WRITE: access.can_write(claims, owner, repo, platform_principal=True, holder=holder),
        "preflight": access.preflight(
            claims,
            access.can_write(claims, owner, repo, platform_principal=True, holder=holder),
            now=0,
            min_ttl_s=60,
        ),
        ADMIN: access.can_manage_repo(claims, owner, repo, platform_principal=True, holder=holder),
        "store-admin": access.is_admin(claims),
    }
    if owner != "root":
        decisions[OWNER_CREATE] = access.can_claim_owner(claims, owner)
    return {name for name, decision in decisions.items() if decision.allowed}


@settings(max_examples=400, deadline=None)
@given(parent=grant_sets, child=grant_sets, holder_of=holders, plt=st.booleans())
def test_whatever_access_allows_an_attenuated_child_it_allows_the_parent(parent, child, holder_of, plt):
    held = frozenset(o for o, h in holder_of.items() if h == SUB)
    if not is_subset(child, parent, held_owners=held):
        return
    parent_claims, child_claims = _claims(parent, plt), _claims(child, plt)
    for owner in OWNERS:
        for repo in REPOS:
            holder = holder_of.get(owner)
            extra = _allowed(child_claims, owner, repo, holder) - _allowed(parent_claims, owner, repo, holder)
            assert not extra, f"the child may {sorted(extra)} on {owner}/{repo} and the parent may not"
