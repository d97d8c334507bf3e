"""Cap-tokens: grants (pure), signing keys, and the token service on SQLite and PostgreSQL."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.rsa import generate_private_key
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy import delete, update

from cgstore import access
from cgstore.audit.chain import GENESIS, HEAD_ID
from cgstore.audit.models import AuditEvent, AuditHead
from cgstore.core.db import Database
from cgstore.core.errors import BadRequest, Denied, NameInvalid, NameUnknown, RootReserved, TokenInvalid
from cgstore.core.names import RESERVED_OWNERS
from cgstore.owners.models import Owner, Principal
from cgstore.owners.service import is_platform_principal, register_principal
from cgstore.settings import Settings
from cgstore.tokens.claims import MAX_TTL_S, Claims
from cgstore.tokens.grants import (
    ACTIONS,
    LITERAL_OWNER_ACTIONS,
    Grant,
    GrantInvalid,
    grant_allows,
    grant_allows_owner,
    is_glob,
    is_subset,
    owner_pattern_matches,
    parse_grant,
    parse_grants,
    repo_pattern_matches,
)
from cgstore.tokens.models import SigningKey, TokenRecord
from cgstore.tokens.ring import KeyConfigError, KeyRing, key_id, load_or_create_signing_key
from cgstore.tokens.service import LEEWAY_S, TokenService
from tests.support.services import postgres_database

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN_TABLES = [
    Principal.__table__,
    Owner.__table__,
    TokenRecord.__table__,
    SigningKey.__table__,
    AuditEvent.__table__,
    AuditHead.__table__,
]


def create_token_tables(database: Database) -> None:
    """The token tables, and the audit chain's head row the migration would insert."""
    TokenRecord.metadata.create_all(database.engine, tables=TOKEN_TABLES)
    with database.session() as session:
        session.add(AuditHead(id=HEAD_ID, last_id=0, digest=GENESIS))


def g(text: str) -> Grant:
    return parse_grant(text)


def gs(*texts: str) -> tuple[Grant, ...]:
    return tuple(parse_grant(t) for t in texts)


# =============================================================================
# grants: parsing
# =============================================================================


def test_parse_json_and_cli_forms_agree() -> None:
    from_json = parse_grant({"repo": "acme/*", "actions": ["write", "read"]})
    from_cli = parse_grant("acme/*:read,write")
    assert from_json == from_cli == Grant("acme", "*", frozenset({"read", "write"}))
    assert from_json.to_json() == {"repo": "acme/*", "actions": ["read", "write"]}
    assert parse_grant(from_json.to_cli()) == from_json
    assert parse_grant(from_json) is from_json


def test_cli_pattern_ends_at_the_first_colon() -> None:
    grant = parse_grant("acme/*:read, owner:create")
    assert grant.pattern == "acme/*"
    assert grant.actions == {"read", "owner:create"}


@pytest.mark.parametrize(
    "value",
    [
        "acme/*",  # no actions
        "acme/*:",
        "acme:read",  # no slash
        "acme/x/y:read",  # a second slash would let a glob cross parts
        "/x:read",
        "acme/:read",
        "Acme/*:read",  # literals must be valid names
        "r\u043e\u043et/*:read",
        "acme/[ab]:read",  # only * and ? are glob characters
        "acme/[!a]*:read",
        "acme/x\\*:read",
        "acme/x{a,b}:read",
        "acme/*:read,delete",
        "acme/*:READ",
        "acme/*\n:read",
        "*" * 65 + "/x:read",
        {"repo": "acme/*"},
        {"repo": "acme/*", "actions": []},
        {"repo": "acme/*", "actions": "read"},
        {"repo": "acme/*", "actions": [1]},
        {"repo": "acme/*", "actions": [["read"]]},
        {"repo": "acme/*", "actions": ["read"], "extra": 1},
        {"repo": 5, "actions": ["read"]},
        5,
        None,
    ],
)
def test_malformed_grants_are_refused(value: object) -> None:
    with pytest.raises(GrantInvalid) as info:
        parse_grant(value)
    assert isinstance(info.value, BadRequest)


def test_parse_grants_wants_a_list() -> None:
    assert parse_grants([]) == ()
    for bad in ["acme/*:read", {"repo": "acme/*", "actions": ["read"]}, 3]:
        with pytest.raises(GrantInvalid):
            parse_grants(bad)
    with pytest.raises(GrantInvalid):
        parse_grants(["acme/*:read"] * 65)


# =============================================================================
# grants: matching
# =============================================================================


def test_owner_and_repo_are_matched_separately() -> None:
    grant = g("acme/*:write")
    assert grant.allows("acme", "models", "write")
    assert not grant.allows("acme-evil", "x", "write")
    assert not g("acme*/x:read").allows("acme", "y", "read")
    assert g("acme*/x:read").allows("acme-evil", "x", "read")
    # names that are not valid never match, so a "/" cannot ride in via a name
    assert not g("*/*:read").allows("acme/x", "y", "read")
    assert not g("*/*:read").allows("acme", "x/y", "read")
    assert not g("*/*:read").allows("Acme", "x", "read")
    assert not g("*/*:read").allows("acme", "x\n", "read")


@pytest.mark.parametrize("pattern", ["*", "r*", "?oot", "ro?t", "*t", "r*t", "*o*", "????"])
def test_wildcard_owner_never_matches_root(pattern: str) -> None:
    assert not g(f"{pattern}/*:read,write").allows("root", "models", "read")
    assert g("root/*:read").allows("root", "models", "read")


@pytest.mark.parametrize("owner", sorted(RESERVED_OWNERS))
def test_wildcard_owner_never_matches_any_reserved_owner(owner: str) -> None:
    assert not g("*/*:write").allows(owner, "x", "write")
    assert g(f"{owner}/*:write").allows(owner, "x", "write")


def test_repo_globs() -> None:
    grant = g("acme/flux-?-*:read")
    assert grant.allows("acme", "flux-2-klein", "read")
    assert not grant.allows("acme", "flux-22", "read")
    assert g("acme/models:read").allows("acme", "models", "read")
    assert not g("acme/models:read").allows("acme", "models2", "read")


def test_write_implies_read_and_nothing_else_implies_anything() -> None:
    assert g("acme/*:write").allows("acme", "x", "read")
    assert not g("acme/*:read").allows("acme", "x", "write")
    assert not g("acme/*:admin").allows("acme", "x", "read")
    assert not g("acme/*:admin").allows("acme", "x", "write")
    assert not g("acme/*:owner:create").allows("acme", "x", "write")


def test_grant_allows_any_of_several() -> None:
    grants = gs("acme/a:read", "beta/*:write")
    assert grant_allows(grants, "acme", "a", "read")
    assert grant_allows(grants, "beta", "x", "write")
    assert not grant_allows(grants, "acme", "b", "read")
    assert not grant_allows((), "acme", "a", "read")


def test_owner_wide_actions_need_the_whole_owner() -> None:
    assert grant_allows_owner(gs("acme/*:owner:create"), "acme", "owner:create")
    assert grant_allows_owner(gs("*/*:owner:create"), "acme", "owner:create")
    assert not grant_allows_owner(gs("*/*:owner:create"), "root", "owner:create")
    assert not grant_allows_owner(gs("acme/models:owner:create"), "acme", "owner:create")
    assert not grant_allows_owner(gs("acme/*:read"), "acme", "owner:create")


# =============================================================================
# grants: attenuation subsets
# =============================================================================


@pytest.mark.parametrize(
    ("child", "parent"),
    [
        (["acme/*:read"], ["acme/*:read,write"]),
        (["acme/models:write"], ["acme/*:write"]),
        (["acme/flux-*:read"], ["acme/*:read"]),
        (["acme/models:read"], ["acme/*:write"]),  # write implies read
        (["acme-*/x:read"], ["*/*:read"]),
        (["acme/x:read", "acme/y:write"], ["acme/x:read", "acme/*:write"]),
        (["acme/x:read,write"], ["acme/*:read", "acme/x:write"]),  # per action
        (["root/models:write"], ["root/*:write"]),
        (["root/*:write"], ["root/*:write"]),
        ([], ["acme/*:read"]),
        ([], []),
    ],
)
def test_is_subset_accepts_narrower(child: list[str], parent: list[str]) -> None:
    assert is_subset(gs(*child), gs(*parent))


@pytest.mark.parametrize(
    ("child", "parent"),
    [
        (["acme/*:write"], ["acme/*:read"]),  # wider action
        (["acme/*:read"], ["acme/models:read"]),  # wider pattern
        (["*/*:read"], ["acme/*:read"]),
        (["acme-evil/x:read"], ["acme/*:read"]),
        (["root/x:read"], ["*/*:read"]),  # * never covers root
        (["root/*:write"], ["*/*:write"]),
        (["admin/x:admin"], ["*/*:admin"]),
        (["acme/a*:read"], ["acme/ab*:read"]),
        (["acme/ab*:read"], ["acme/a*:read"]),  # narrower in fact, but not provably: refused
        (["acme/x:admin"], ["acme/*:write"]),
        (["acme/x:read"], []),
    ],
)
def test_is_subset_refuses_wider_or_unprovable(child: list[str], parent: list[str]) -> None:
    assert not is_subset(gs(*child), gs(*parent))


# -- property tests -------------------------------------------------------------

# Small alphabets so that random patterns and names collide often.
OWNER_CHARS = "ab-"
REPO_CHARS = "ab.-"


def _part(chars: str, globs: bool, edge: str, max_size: int) -> st.SearchStrategy[str]:
    middle = st.text(alphabet=chars + ("*?" if globs else ""), max_size=max_size)
    ends = st.sampled_from(edge + ("*?" if globs else ""))
    return st.builds(lambda a, m, b: a + m + b, ends, middle, ends) | ends


owner_names = st.sampled_from(sorted(RESERVED_OWNERS)) | _part("ab-", False, "ab", 3).filter(
    lambda s: owner_pattern_matches(s, s)
)
repo_names = _part("ab.-", False, "ab", 3).filter(lambda s: repo_pattern_matches(s, s))
owner_patterns = st.sampled_from(["*", "root", "admin", "r*", "*t", "?oot"]) | _part("ab-", True, "ab", 3).filter(
    lambda s: _parses(f"{s}/x:read")
)
repo_patterns = st.just("*") | _part("ab.-", True, "ab", 3).filter(lambda s: _parses(f"a/{s}:read"))
actions = st.sets(st.sampled_from(sorted(ACTIONS)), min_size=1, max_size=4).map(frozenset)
grants = st.builds(Grant, owner_patterns, repo_patterns, actions)
grant_lists = st.lists(grants, max_size=4).map(tuple)


def _parses(text: str) -> bool:
    try:
        parse_grant(text)
        return True
    except GrantInvalid:
        return False


@given(owner_patterns, repo_patterns, st.sampled_from(sorted(RESERVED_OWNERS)), repo_names)
def test_prop_wildcard_owner_never_matches_reserved(op: str, rp: str, owner: str, repo: str) -> None:
    if is_glob(op):
        assert not owner_pattern_matches(op, owner)
        assert not Grant(op, rp, ACTIONS).allows(owner, repo, "read")


@given(owner_names, repo_names, owner_names, repo_names)
def test_prop_literal_grant_matches_exactly_itself(o: str, r: str, o2: str, r2: str) -> None:
    grant = Grant(o, r, frozenset({"read"}))
    assert grant.matches(o, r)
    assert grant.matches(o2, r2) == ((o2, r2) == (o, r))


@given(owner_patterns, repo_patterns, owner_names, repo_names, st.text(alphabet="ab-", min_size=1, max_size=3))
def test_prop_owner_and_repo_separate(op: str, rp: str, owner: str, repo: str, suffix: str) -> None:
    grant = Grant(op, rp, frozenset({"read"}))
    assert grant.matches(owner, repo) == (owner_pattern_matches(op, owner) and repo_pattern_matches(rp, repo))
    # A literal owner never leaks into a longer owner name, whatever the repo glob.
    longer = owner + suffix
    if not is_glob(op) and longer != op:
        assert not Grant(op, "*", frozenset({"read"})).matches(longer, repo)


@hsettings(max_examples=400)
@given(grant_lists, grant_lists, owner_names, repo_names, st.sampled_from(sorted(ACTIONS)))
def test_prop_subset_is_sound(child, parent, owner: str, repo: str, action: str) -> None:
    if is_subset(child, parent) and grant_allows(child, owner, repo, action):
        assert grant_allows(parent, owner, repo, action)


def _instantiate(pattern: str, chars: str, data) -> str:
    """A name the pattern matches (when it is valid): each * and ? filled at random."""
    out = []
    for ch in pattern:
        if ch == "*":
            out.append(data.draw(st.text(alphabet=chars, max_size=3)))
        elif ch == "?":
            out.append(data.draw(st.sampled_from(chars)))
        else:
            out.append(ch)
    return "".join(out)


def _derived_part(parent_part: str, randoms: st.SearchStrategy[str], chars: str, data) -> str:
    # Same as the parent, a random pattern, or a name the parent's pattern matches:
    # so that is_subset holds often, and fails often, on related patterns.
    choice = data.draw(st.sampled_from(["same", "random", "instance"]))
    if choice == "same":
        return parent_part
    if choice == "random":
        return data.draw(randoms)
    return _instantiate(parent_part, chars, data)


@hsettings(max_examples=1000)
@given(grants, st.data())
def test_prop_subset_is_sound_on_names_the_child_matches(parent: Grant, data) -> None:
    child_owner = _derived_part(parent.owner_pattern, owner_patterns, "ab-", data)
    child_repo = _derived_part(parent.repo_pattern, repo_patterns, "ab.-", data)
    child_actions = data.draw(actions)
    if not (_parses(f"{child_owner}/{child_repo}:read")):
        return
    child = Grant(child_owner, child_repo, child_actions)
    if not is_subset((child,), (parent,)):
        return
    owner = _instantiate(child_owner, "ab-", data)
    repo = _instantiate(child_repo, "ab.-", data)
    for action in ACTIONS:
        if child.allows(owner, repo, action):
            assert parent.allows(owner, repo, action), (child, parent, owner, repo, action)


@given(grants, owner_names, repo_names, st.data())
def test_prop_narrowing_is_always_accepted(parent: Grant, owner: str, repo: str, data) -> None:
    # Replace each part the parent matches by that literal name, and drop actions.
    child_owner = owner if owner_pattern_matches(parent.owner_pattern, owner) else parent.owner_pattern
    child_repo = repo if repo_pattern_matches(parent.repo_pattern, repo) else parent.repo_pattern
    kept = data.draw(st.sets(st.sampled_from(sorted(parent.actions)), min_size=1))
    child = Grant(child_owner, child_repo, frozenset(kept))
    # Naming an owner the parent reaches by a wildcard is narrowing when the
    # principal holds it; for write/admin it is not otherwise (the literal name
    # would be write authority the wildcard never gave).
    assert is_subset((child,), (parent,), held_owners={owner})
    literal_from_wildcard = is_glob(parent.owner_pattern) and not is_glob(child_owner)
    writes = bool(child.actions & LITERAL_OWNER_ACTIONS)
    assert is_subset((child,), (parent,)) == (not (literal_from_wildcard and writes))
    assert is_subset((parent,), (parent,))


# =============================================================================
# signing keys
# =============================================================================


def make_settings(home: Path, **extra) -> Settings:
    return Settings(home=home, **extra)


def test_signing_key_is_generated_once_with_0600(db: Database, tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "deep" / "home")
    first = KeyRing(db, settings)
    path = settings.signing_key_path
    assert path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second = KeyRing(db, settings)
    assert first.bootstrap_kid == second.bootstrap_kid
    with db.session() as session:
        assert first.signing_key(session)[0] == first.bootstrap_kid
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_existing_signing_key_is_used(db: Database, tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    path = tmp_path / "key.pem"
    path.write_bytes(_private_pem(key))
    ring = KeyRing(db, make_settings(tmp_path, token_signing_key=path))
    assert ring.bootstrap_kid == key_id(key.public_key())


def test_concurrent_processes_agree_on_one_key(tmp_path: Path) -> None:
    path = tmp_path / "home" / "token-signing-key.pem"
    start_at = time.time() + 1.5  # every process waits for the same instant, then races
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from cgstore.tokens.ring import key_id, load_or_create_signing_key
        time.sleep(max(0.0, {start_at!r} - time.time()))
        print(key_id(load_or_create_signing_key(Path({str(path)!r})).public_key()))
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        for _ in range(6)
    ]
    kids = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert len(kids) == 1 and len(next(iter(kids))) == 16
    assert key_id(load_or_create_signing_key(path).public_key()) in kids


def test_wrong_key_types_are_refused(db: Database, tmp_path: Path) -> None:
    rsa = generate_private_key(public_exponent=65537, key_size=2048)
    rsa_path = tmp_path / "rsa.pem"
    rsa_path.write_bytes(_private_pem(rsa))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a key")
    for bad in [rsa_path, garbage]:
        with pytest.raises(KeyConfigError):
            KeyRing(db, make_settings(tmp_path, token_signing_key=bad))


def test_rotate_signs_with_the_new_key_and_the_old_keeps_verifying(svc: TokenService, db: Database) -> None:
    old = svc.mint("alice", ["acme/*:read"], ttl_s=600)
    with db.session() as session:
        new_kid = svc.ring.rotate(session)
    assert stat.S_IMODE((svc.ring._keys_dir / f"{new_kid}.pem").stat().st_mode) == 0o600
    new = svc.mint("alice", ["acme/*:read"], ttl_s=600)
    assert jwt.get_unverified_header(new.token)["kid"] == new_kid != jwt.get_unverified_header(old.token)["kid"]
    assert svc.verify(old.token).jti == old.jti and svc.verify(new.token).jti == new.jti
    with db.session() as session:
        assert svc.ring.retire(session, svc.ring.bootstrap_kid) is True
        assert svc.ring.retire(session, svc.ring.bootstrap_kid) is False  # already retired
    with pytest.raises(TokenInvalid, match="retired key"):
        svc.verify(old.token)
    assert svc.verify(new.token).jti == new.jti
    with db.session() as session:
        assert [k["kid"] for k in svc.ring.jwks(session)] == [new_kid]


def test_the_last_signing_key_cannot_be_retired(svc: TokenService, db: Database) -> None:
    with db.session() as session, pytest.raises(BadRequest, match="rotate"):
        svc.ring.retire(session, svc.ring.bootstrap_kid)
    with db.session() as session, pytest.raises(NameUnknown):
        svc.ring.retire(session, "0" * 16)


def test_rotation_on_one_instance_reaches_another_without_restart(db: Database, tmp_path: Path, clock) -> None:
    # Two processes on two hosts: one database, separate homes (keys on their own disks).
    a = TokenService(db, make_settings(tmp_path / "a"), clock=clock)
    b = TokenService(db, make_settings(tmp_path / "b"), clock=clock)
    token_a = a.mint("alice", ["acme/*:read"], ttl_s=600).token
    with db.session() as session:
        kid = b.ring.rotate(session)
    token_b = b.mint("alice", ["acme/*:read"], ttl_s=600).token
    assert jwt.get_unverified_header(token_b)["kid"] == kid
    assert a.verify(token_b).sub == b.verify(token_a).sub == "alice"
    # a holds no private half of kid: it keeps signing with its own newest key.
    assert jwt.get_unverified_header(a.mint("bob", [], ttl_s=60).token)["kid"] == a.ring.bootstrap_kid
    with db.session() as session:
        b.ring.retire(session, a.ring.bootstrap_kid)
    with pytest.raises(TokenInvalid, match="retired"):
        b.verify(token_a)


def test_jwks_carries_no_private_part(svc: TokenService, db: Database) -> None:
    with db.session() as session:
        keys = svc.ring.jwks(session)
    assert keys and set(keys[0]) == {"kty", "crv", "x", "kid", "alg", "use"}
    x = base64.urlsafe_b64decode(keys[0]["x"] + "==")
    with db.session() as session:
        kid, private = svc.ring.signing_key(session)
    assert key_id(private.public_key()) == kid == keys[0]["kid"]
    assert x == private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _private_pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _public_pem(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


# =============================================================================
# the service, on SQLite and PostgreSQL
# =============================================================================


class FakeClock:
    """A clock tests move by hand; TokenService reads it instead of time.time."""

    def __init__(self) -> None:
        self.now = float(int(time.time()))

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="module")
def postgres_db() -> Iterator[Database]:
    with postgres_database() as url:
        database = Database(url)
        create_token_tables(database)
        try:
            yield database
        finally:
            database.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def db(request, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        database = Database(f"sqlite:///{tmp_path / 'tokens.sqlite3'}")
        create_token_tables(database)
        yield database
        database.dispose()
        return
    database = request.getfixturevalue("postgres_db")
    yield database
    # One database per module: empty the tables between tests.
    with database.session() as session:
        session.execute(delete(AuditEvent))
        session.execute(delete(TokenRecord))
        session.execute(delete(Owner))
        session.execute(delete(Principal))
        session.execute(delete(SigningKey))


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path / "home")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def svc(db: Database, settings: Settings, clock: FakeClock) -> TokenService:
    return TokenService(db, settings, clock=clock)


def key_of(svc: TokenService):
    with svc.db.session() as session:
        return svc.ring.signing_key(session)[1]


def kid_of(svc: TokenService) -> str:
    with svc.db.session() as session:
        return svc.ring.signing_key(session)[0]


def can_write(svc: TokenService, claims: Claims, owner: str, repo: str, holder: str | None = None) -> None:
    with svc.db.session() as session:
        platform = is_platform_principal(session, claims.sub)
    access.can_write(claims, owner, repo, platform_principal=platform, holder=holder).enforce()


def is_platform(svc: TokenService, name: str) -> bool:
    with svc.db.session() as session:
        return is_platform_principal(session, name)


def _forge(payload: dict, key, **headers) -> str:
    return jwt.encode(payload, key, algorithm="EdDSA", headers=headers or None)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


# -- mint / verify ----------------------------------------------------------------


def test_round_trip(svc: TokenService, clock: FakeClock) -> None:
    minted = svc.mint("alice", ["acme/*:read,write"], ttl_s=600)
    claims = svc.verify(minted.token)
    assert claims == minted.claims
    assert claims.sub == "alice" and claims.aud == "cgstore" and claims.iss == "cgstore"
    assert claims.exp == minted.exp == int(clock.now) + 600 and claims.iat == int(clock.now)
    assert claims.jti == minted.jti and claims.parent is None and claims.plt is False
    assert claims.allows("acme", "models", "write")
    header = jwt.get_unverified_header(minted.token)
    assert header["alg"] == "EdDSA" and header["kid"] == kid_of(svc)
    payload = jwt.decode(minted.token, options={"verify_signature": False})
    assert payload["grants"] == [{"repo": "acme/*", "actions": ["read", "write"]}]
    assert "parent" not in payload


def test_grants_in_json_form_are_accepted(svc: TokenService) -> None:
    minted = svc.mint("alice", [{"repo": "acme/models", "actions": ["read"]}], ttl_s=60)
    assert svc.verify(minted.token).grants == gs("acme/models:read")


def test_token_from_another_service_instance_verifies(db: Database, settings: Settings) -> None:
    first, second = TokenService(db, settings), TokenService(db, settings)
    assert first.ring.bootstrap_kid == second.ring.bootstrap_kid
    assert second.verify(first.mint("alice", [], ttl_s=60).token).sub == "alice"


def test_expired_token(svc: TokenService, clock: FakeClock) -> None:
    token = svc.mint("alice", ["acme/*:read"], ttl_s=60).token
    clock.advance(60 + LEEWAY_S)  # within the leeway: still fine
    svc.verify(token)
    clock.advance(1)
    with pytest.raises(TokenInvalid, match="expired"):
        svc.verify(token)


def test_token_from_the_future(svc: TokenService, clock: FakeClock) -> None:
    token = svc.mint("alice", [], ttl_s=600).token
    clock.advance(-(LEEWAY_S + 5))
    with pytest.raises(TokenInvalid, match="future"):
        svc.verify(token)


def _payload(svc: TokenService, clock: FakeClock, **over) -> dict:
    now = int(clock.now)
    base = {
        "iss": "cgstore",
        "aud": "cgstore",
        "sub": "alice",
        "iat": now,
        "exp": now + 600,
        "jti": "0" * 32,
        "plt": False,
        "grants": [{"repo": "acme/*", "actions": ["read"]}],
    }
    base.update(over)
    return {k: v for k, v in base.items() if v is not _DROP}


_DROP = object()


def test_forged_signature(svc: TokenService, clock: FakeClock) -> None:
    real = svc.mint("alice", ["acme/*:read"], ttl_s=600)
    payload = jwt.decode(real.token, options={"verify_signature": False})
    other = Ed25519PrivateKey.generate()
    with pytest.raises(TokenInvalid, match="signature"):
        svc.verify(_forge(payload, other, kid=kid_of(svc)))
    with pytest.raises(TokenInvalid, match="unknown key"):  # a token must name its key
        svc.verify(_forge(payload, other))
    with pytest.raises(TokenInvalid, match="unknown key"):
        svc.verify(_forge(payload, other, kid=key_id(other.public_key())))
    # A real token whose payload was edited (grants widened) no longer verifies.
    head, body, sig = real.token.split(".")
    widened = dict(payload, grants=[{"repo": "*/*", "actions": ["write"]}])
    tampered = f"{head}.{_b64(json.dumps(widened).encode())}.{sig}"
    with pytest.raises(TokenInvalid, match="signature"):
        svc.verify(tampered)


def test_alg_none_is_refused(svc: TokenService, clock: FakeClock) -> None:
    token = jwt.encode(_payload(svc, clock), None, algorithm="none")
    with pytest.raises(TokenInvalid, match="algorithm"):
        svc.verify(token)


def test_hs256_with_the_public_key_is_refused(svc: TokenService, clock: FakeClock) -> None:
    # The classic confusion: HMAC "signed" with the verifier's public key as the secret.
    public_pem = _public_pem(key_of(svc))
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid_of(svc)}).encode())
    body = _b64(json.dumps(_payload(svc, clock)).encode())
    signature = hmac.new(public_pem, f"{header}.{body}".encode(), hashlib.sha256).digest()
    with pytest.raises(TokenInvalid, match="algorithm"):
        svc.verify(f"{header}.{body}.{_b64(signature)}")


def test_eddsa_header_with_hmac_signature_is_refused(svc: TokenService, clock: FakeClock) -> None:
    header = _b64(json.dumps({"alg": "EdDSA", "kid": kid_of(svc)}).encode())
    body = _b64(json.dumps(_payload(svc, clock)).encode())
    signature = hmac.new(_public_pem(key_of(svc)), f"{header}.{body}".encode(), hashlib.sha256)
    with pytest.raises(TokenInvalid):
        svc.verify(f"{header}.{body}.{_b64(signature.digest())}")


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"aud": "other"}, "audience"),
        ({"aud": ["cgstore", "other"]}, "audience"),
        ({"iss": "someone-else"}, "issuer"),
        ({"iss": "cgstore-evil"}, "issuer"),
    ],
)
def test_wrong_audience_or_issuer(svc: TokenService, clock: FakeClock, over: dict, match: str) -> None:
    token = _forge(_payload(svc, clock, **over), key_of(svc), kid=kid_of(svc))
    with pytest.raises(TokenInvalid, match=match):
        svc.verify(token)


@pytest.mark.parametrize("claim", ["iss", "aud", "sub", "iat", "exp", "jti", "plt", "grants"])
def test_missing_claims(svc: TokenService, clock: FakeClock, claim: str) -> None:
    token = _forge(_payload(svc, clock, **{claim: _DROP}), key_of(svc), kid=kid_of(svc))
    with pytest.raises(TokenInvalid, match="missing claim|malformed"):
        svc.verify(token)


@pytest.mark.parametrize(
    "over",
    [
        {"plt": "true"},
        {"plt": 1},
        {"iat": "now"},
        {"exp": 1.5e12},
        {"exp": True},
        {"sub": ""},
        {"sub": 7},
        {"sub": "x" * 201},
        {"jti": 7},
        {"jti": "../../x"},
        {"parent": 5},
        {"grants": {"repo": "acme/*", "actions": ["read"]}},
        {"grants": [{"repo": "acme/[a]", "actions": ["read"]}]},
        {"grants": [{"repo": "acme/*", "actions": ["sudo"]}]},
        {"grants": ["acme/*:read"] * 65},
    ],
)
def test_ill_typed_claims(svc: TokenService, clock: FakeClock, over: dict) -> None:
    token = _forge(_payload(svc, clock, **over), key_of(svc), kid=kid_of(svc))
    with pytest.raises(TokenInvalid, match="malformed"):
        svc.verify(token)


@pytest.mark.parametrize(
    "garbage",
    ["", "abc", "a.b.c", "Bearer x", "...", "e30.e30.", "x" * 20000, "\u00e9.\u00e9.\u00e9", None, 42, b"a.b.c"],
)
def test_garbage_is_token_invalid(svc: TokenService, garbage: object) -> None:
    with pytest.raises(TokenInvalid):
        svc.verify(garbage)


def test_well_signed_but_unrecorded_token_is_unknown(svc: TokenService, clock: FakeClock) -> None:
    token = _forge(_payload(svc, clock), key_of(svc), kid=kid_of(svc))
    with pytest.raises(TokenInvalid, match="unknown token"):
        svc.verify(token)


# -- mint validation ---------------------------------------------------------------


@pytest.mark.parametrize("sub", ["", " alice", "alice ", "al\nice", "x" * 201, None, 5, "tab\there"])
def test_mint_refuses_bad_sub(svc: TokenService, sub: object) -> None:
    with pytest.raises(BadRequest):
        svc.mint(sub, [], ttl_s=60)


@pytest.mark.parametrize("ttl_s", [0, -1, MAX_TTL_S + 1, True, 1.5, "60", None])
def test_mint_refuses_bad_ttl(svc: TokenService, ttl_s: object) -> None:
    with pytest.raises(BadRequest):
        svc.mint("alice", [], ttl_s=ttl_s)


def test_mint_accepts_the_longest_ttl_and_sub(svc: TokenService) -> None:
    svc.verify(svc.mint("x" * 200, [], ttl_s=MAX_TTL_S).token)


def test_mint_refuses_bad_grants(svc: TokenService) -> None:
    with pytest.raises(GrantInvalid):
        svc.mint("alice", ["acme/[x]:read"], ttl_s=60)
    with pytest.raises(BadRequest):
        svc.mint("alice", [], ttl_s=60, platform="yes")


# -- revocation ----------------------------------------------------------------------


def test_revoked_token_is_invalid(svc: TokenService) -> None:
    minted = svc.mint("alice", ["acme/*:read"], ttl_s=600)
    assert svc.revoke(minted.jti) == 1
    with pytest.raises(TokenInvalid, match="revoked"):
        svc.verify(minted.token)
    assert svc.revoke(minted.jti) == 0  # idempotent


def test_revoking_a_parent_revokes_the_whole_subtree(svc: TokenService) -> None:
    root = svc.mint("job", ["acme/*:read,write"], ttl_s=600)
    child_a = svc.attenuate(root.claims, ["acme/a:write"], ttl_s=300)
    child_b = svc.attenuate(root.claims, ["acme/b:read"], ttl_s=300)
    grandchild = svc.attenuate(child_a.claims, ["acme/a:read"], ttl_s=60)
    sibling = svc.mint("job", ["acme/*:read"], ttl_s=600)
    assert svc.revoke(child_a.jti) == 2
    for token in (child_a, grandchild):
        with pytest.raises(TokenInvalid, match="revoked"):
            svc.verify(token.token)
    svc.verify(child_b.token)
    assert svc.revoke(root.jti) == 2  # root and child_b; the rest already revoked
    for token in (root, child_b):
        with pytest.raises(TokenInvalid, match="revoked"):
            svc.verify(token.token)
    svc.verify(sibling.token)


def test_revoked_ancestor_invalidates_a_child_not_yet_marked(svc: TokenService, db: Database) -> None:
    # A child recorded while its parent was being revoked is not marked itself;
    # verify walks the ancestors, so it is refused anyway.
    parent = svc.mint("job", ["acme/*:read"], ttl_s=600)
    child = svc.attenuate(parent.claims, ["acme/x:read"], ttl_s=60)
    with db.session() as session:
        session.execute(
            update(TokenRecord).where(TokenRecord.jti == parent.jti).values(revoked_at=dt.datetime.now(dt.UTC))
        )
    with pytest.raises(TokenInvalid, match="parent token was revoked"):
        svc.verify(child.token)
    assert {t.jti: t.status for t in svc.list_tokens().tokens}[child.jti] == "revoked"


def test_a_revoked_grandparent_invalidates_a_grandchild(svc: TokenService, db: Database) -> None:
    root = svc.mint("job", ["acme/*:read"], ttl_s=600)
    middle = svc.attenuate(root.claims, ["acme/*:read"], ttl_s=300)
    leaf = svc.attenuate(middle.claims, ["acme/x:read"], ttl_s=60)
    assert svc.verify(leaf.token).jti == leaf.jti
    with db.session() as session:
        session.execute(
            update(TokenRecord).where(TokenRecord.jti == root.jti).values(revoked_at=dt.datetime.now(dt.UTC))
        )
    with pytest.raises(TokenInvalid, match="parent token was revoked"):
        svc.verify(leaf.token)


def test_a_cyclic_chain_is_refused(svc: TokenService, db: Database) -> None:
    root = svc.mint("job", ["acme/*:read"], ttl_s=600)
    middle = svc.attenuate(root.claims, ["acme/*:read"], ttl_s=300)
    leaf = svc.attenuate(middle.claims, ["acme/x:read"], ttl_s=60)
    with db.session() as session:  # a corrupt table: the root points back at the leaf
        session.execute(update(TokenRecord).where(TokenRecord.jti == root.jti).values(parent_jti=leaf.jti))
    with pytest.raises(TokenInvalid, match="chain is corrupt"):
        svc.verify(leaf.token)


def test_revoke_unknown_jti(svc: TokenService) -> None:
    with pytest.raises(NameUnknown):
        svc.revoke("f" * 32)
    with pytest.raises(NameUnknown):
        svc.revoke(None)  # type: ignore[arg-type]


def test_list_tokens_with_status(svc: TokenService, clock: FakeClock) -> None:
    short = svc.mint("alice", ["acme/*:read"], ttl_s=10)
    revoked = svc.mint("alice", ["acme/*:read"], ttl_s=600)
    active = svc.mint("bob", ["beta/*:write"], ttl_s=600)
    svc.revoke(revoked.jti)
    clock.advance(11)
    statuses = {t.jti: t.status for t in svc.list_tokens().tokens}
    assert statuses == {short.jti: "expired", revoked.jti: "revoked", active.jti: "active"}
    bobs = svc.list_tokens(sub="bob").tokens
    assert [t.jti for t in bobs] == [active.jti]
    assert bobs[0].grants == [{"repo": "beta/*", "actions": ["write"]}]
    assert bobs[0].expires_at == dt.datetime.fromtimestamp(active.exp, dt.UTC)


# -- attenuation -----------------------------------------------------------------------


def test_attenuate_narrower(svc: TokenService, clock: FakeClock) -> None:
    parent = svc.mint("job", ["acme/*:read,write"], ttl_s=3600)
    child = svc.attenuate(parent.claims, ["acme/models:write"], ttl_s=300)
    claims = svc.verify(child.token)
    assert claims.parent == parent.jti and claims.sub == "job" and claims.plt is False
    assert claims.allows("acme", "models", "write")
    assert not claims.allows("acme", "other", "write")
    assert claims.exp == int(clock.now) + 300
    payload = jwt.decode(child.token, options={"verify_signature": False})
    assert payload["parent"] == parent.jti
    # Exactly up to the parent's expiry is fine.
    svc.attenuate(parent.claims, ["acme/models:read"], ttl_s=3600)


@pytest.mark.parametrize(
    "grants",
    [
        ["acme/*:read,write,admin"],  # wider action
        ["acme/*:owner:create"],
        ["*/*:read"],  # wider pattern
        ["acme-evil/x:read"],
        ["root/*:write"],
        ["acme/models:read", "beta/x:read"],  # one grant too many
    ],
)
def test_attenuate_wider_grants_is_denied(svc: TokenService, grants: list[str]) -> None:
    parent = svc.mint("job", ["acme/*:read,write"], ttl_s=3600)
    with pytest.raises(Denied, match="wider"):
        svc.attenuate(parent.claims, grants, ttl_s=60)


def test_attenuate_past_the_parent_expiry_is_denied_not_clamped(svc: TokenService, clock: FakeClock) -> None:
    parent = svc.mint("job", ["acme/*:read"], ttl_s=600)
    clock.advance(100)
    with pytest.raises(Denied, match="exp .* is later than the parent"):
        svc.attenuate(parent.claims, ["acme/x:read"], ttl_s=501)
    svc.attenuate(parent.claims, ["acme/x:read"], ttl_s=500)


def test_attenuate_from_a_revoked_parent(svc: TokenService) -> None:
    parent = svc.mint("job", ["acme/*:read"], ttl_s=600)
    claims = svc.verify(parent.token)
    svc.revoke(parent.jti)
    with pytest.raises(TokenInvalid, match="revoked"):
        svc.attenuate(claims, ["acme/x:read"], ttl_s=60)


def test_attenuate_validates_its_request(svc: TokenService) -> None:
    parent = svc.mint("job", ["acme/*:read"], ttl_s=600)
    with pytest.raises(BadRequest):
        svc.attenuate(parent.claims, ["acme/x:read"], ttl_s=0)
    with pytest.raises(GrantInvalid):
        svc.attenuate(parent.claims, ["acme/x"], ttl_s=60)


def test_plt_is_inherited_only_from_a_platform_parent(svc: TokenService) -> None:
    platform = svc.mint("platform-ci", ["root/*:write"], ttl_s=600, platform=True)
    child = svc.attenuate(platform.claims, ["root/flux:write"], ttl_s=60)
    assert svc.verify(child.token).plt is True
    tenant = svc.mint("tenant", ["acme/*:write"], ttl_s=600)
    assert svc.verify(svc.attenuate(tenant.claims, ["acme/x:write"], ttl_s=60).token).plt is False


# -- principals and the root gate ---------------------------------------------------------


def test_platform_principal_registration(svc: TokenService) -> None:
    assert not is_platform(svc, "platform-ci")
    svc.mint("platform-ci", [], ttl_s=60, platform=True)
    assert is_platform(svc, "platform-ci")
    svc.mint("platform-ci", [], ttl_s=60)  # an ordinary token does not demote
    assert is_platform(svc, "platform-ci")
    register_principal(svc.db, "platform-ci", platform=False)  # an explicit demotion does
    assert not is_platform(svc, "platform-ci")
    register_principal(svc.db, "new-bot", platform=True)
    assert is_platform(svc, "new-bot")
    svc.mint("tenant", [], ttl_s=60)
    assert not is_platform(svc, "tenant")


def test_concurrent_first_mints_for_one_principal(svc: TokenService) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def mint() -> None:
        try:
            barrier.wait()
            svc.mint("racer", ["acme/*:read"], ttl_s=60, platform=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=mint) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert is_platform(svc, "racer")
    assert len(svc.list_tokens(sub="racer").tokens) == 8


def test_tenant_wildcard_cannot_write_root(svc: TokenService) -> None:
    claims = svc.verify(svc.mint("tenant", ["*/*:read,write"], ttl_s=600).token)
    can_write(svc, claims, "acme", "models", holder="tenant")  # fine under its own owner
    for owner in sorted(RESERVED_OWNERS):
        with pytest.raises(RootReserved, match="reserved"):
            can_write(svc, claims, owner, "models")


def test_tenant_naming_root_literally_still_cannot_write_it(svc: TokenService) -> None:
    claims = svc.verify(svc.mint("tenant", ["root/*:write"], ttl_s=600).token)
    with pytest.raises(RootReserved):
        can_write(svc, claims, "root", "models")


def test_write_without_a_matching_grant_is_denied(svc: TokenService) -> None:
    claims = svc.verify(svc.mint("tenant", ["acme/*:write", "beta/*:read"], ttl_s=600).token)
    for owner, repo in [("acme-evil", "x"), ("beta", "x"), ("other", "models")]:
        with pytest.raises(Denied):
            can_write(svc, claims, owner, repo)


def test_write_with_invalid_names(svc: TokenService) -> None:
    claims = svc.verify(svc.mint("tenant", ["*/*:write"], ttl_s=600).token)
    for owner, repo in [("Root", "x"), ("r\u043e\u043et", "x"), ("acme", ".."), ("acme\n", "x")]:
        with pytest.raises(NameInvalid):
            can_write(svc, claims, owner, repo)


def test_plt_token_of_an_unregistered_principal_cannot_write_root(svc: TokenService) -> None:
    minted = svc.mint("ex-platform", ["root/*:write"], ttl_s=600, platform=True)
    register_principal(svc.db, "ex-platform", platform=False)
    claims = svc.verify(minted.token)
    assert claims.plt
    with pytest.raises(RootReserved):
        can_write(svc, claims, "root", "models")


def test_platform_principal_without_plt_cannot_write_root(svc: TokenService) -> None:
    register_principal(svc.db, "platform-ci", platform=True)
    claims = svc.verify(svc.mint("platform-ci", ["root/*:write"], ttl_s=600).token)
    assert is_platform(svc, "platform-ci") and not claims.plt
    with pytest.raises(RootReserved):
        can_write(svc, claims, "root", "models")


def test_platform_principal_with_plt_and_root_grant_writes_root(svc: TokenService) -> None:
    claims = svc.verify(svc.mint("platform-ci", ["root/*:write"], ttl_s=600, platform=True).token)
    can_write(svc, claims, "root", "models")
    # ...and through an attenuated child for one repo (the mint-child case).
    child = svc.verify(svc.attenuate(claims, ["root/flux:write"], ttl_s=60).token)
    can_write(svc, child, "root", "flux")
    with pytest.raises(RootReserved):
        can_write(svc, child, "root", "other")


def test_platform_principal_with_plt_but_wildcard_grant_cannot_write_root(svc: TokenService) -> None:
    claims = svc.verify(svc.mint("platform-ci", ["*/*:write"], ttl_s=600, platform=True).token)
    with pytest.raises(RootReserved):
        can_write(svc, claims, "root", "models")
    can_write(svc, claims, "acme", "models", holder="platform-ci")


def test_can_read(svc: TokenService) -> None:
    nothing = svc.verify(svc.mint("anyone", [], ttl_s=600).token)
    assert access.can_read(nothing, "root", "models").allowed  # root/* is public to valid tokens
    assert not access.can_read(nothing, "acme", "models").allowed
    writer = svc.verify(svc.mint("w", ["acme/*:write"], ttl_s=600).token)
    assert access.can_read(writer, "acme", "models").allowed  # write implies read
    reader = svc.verify(svc.mint("r", ["*/*:read"], ttl_s=600).token)
    assert access.can_read(reader, "acme", "models").allowed
    assert not access.can_read(reader, "admin", "models").allowed  # reserved, and not root


def test_claims_are_immutable(svc: TokenService) -> None:
    claims = svc.verify(svc.mint("alice", ["acme/*:read"], ttl_s=60).token)
    assert isinstance(claims, Claims)
    with pytest.raises(AttributeError):
        claims.plt = True  # type: ignore[misc]


def test_signing_key_file_survives_a_service_restart(db: Database, settings: Settings) -> None:
    token = TokenService(db, settings).mint("alice", [], ttl_s=60).token
    mode = stat.S_IMODE(os.stat(settings.signing_key_path).st_mode)
    assert mode == 0o600
    assert TokenService(db, settings).verify(token).sub == "alice"
