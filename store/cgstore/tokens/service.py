"""Cap-tokens: mint, verify, attenuate, revoke; and the write/read gates built on them.

A cap-token is an EdDSA (Ed25519) JWT. Its claims (PROTOCOL.md, "Tokens"):
``iss``, ``aud`` = ``cgstore``, ``sub`` (principal), ``iat``, ``exp``, ``jti``,
``plt`` (platform), ``grants``, and ``parent`` (jti) when attenuated.

A signature alone never makes a token valid: every minted token is recorded,
and ``verify`` also requires the record to exist and neither it nor any
ancestor to be revoked. Nothing is cached between calls, so a revocation takes
effect on the very next request. Every failure is ``TokenInvalid`` (401); no
path falls back to anonymous.

The gates:
- ``can_write``: a matching ``write`` grant, else ``Denied``. Under a reserved
  owner (``root``, ``admin``, ...) the refusal is always ``RootReserved``,
  whichever lock failed (the grant, ``plt``, or the registered platform
  principal), so a tenant learns the namespace is reserved rather than that
  its grant was merely too narrow.
- ``can_read``: ``root/*`` is readable by every valid token; elsewhere a
  ``read`` grant, and ``write`` implies ``read``.

Database errors are not wrapped here: the app maps SQLAlchemy's operational
errors to ``UNAVAILABLE`` globally.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jwt
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from cgstore.core.db import Database
from cgstore.core.errors import BadRequest, Denied, NameUnknown, RootReserved, TokenInvalid
from cgstore.core.names import ROOT_OWNER, is_reserved_owner, validate_owner, validate_repo
from cgstore.settings import Settings
from cgstore.tokens.grants import (
    READ,
    WRITE,
    Grant,
    GrantInvalid,
    grant_allows,
    grant_allows_owner,
    grants_to_json,
    is_subset,
    parse_grants,
)
from cgstore.tokens.keys import KeyRing
from cgstore.tokens.models import Principal, TokenRecord

AUDIENCE = "cgstore"
ALGORITHM = "EdDSA"
MAX_TTL_S = 366 * 24 * 3600
MAX_SUB_LEN = 200
MAX_JTI_LEN = 64  # the tokens.jti column
# Clock skew tolerated between this process and whoever judges "now" elsewhere.
LEEWAY_S = 10
# A token longer than this is garbage (64 grants fit in well under 16 KiB).
MAX_TOKEN_LEN = 16 * 1024
# Attenuation chains are short in practice (platform job → mint child); a
# longer walk means a corrupt table, and a bound keeps verify cheap regardless.
MAX_CHAIN_DEPTH = 32

_REQUIRED_CLAIMS = ("iss", "aud", "sub", "iat", "exp", "jti", "plt", "grants")


@dataclass(frozen=True)
class Claims:
    """The verified claims of a cap-token. Only ``TokenService`` builds these."""

    iss: str
    aud: str
    sub: str
    iat: int
    exp: int
    jti: str
    plt: bool
    grants: tuple[Grant, ...]
    parent: str | None = None

    def allows(self, owner: str, repo: str, action: str) -> bool:
        """Whether a grant allows ``action`` on ``owner/repo`` (grants only: no root gate)."""
        return grant_allows(self.grants, owner, repo, action)

    def allows_owner(self, owner: str, action: str) -> bool:
        """Whether a grant over all of ``owner``'s repos (``owner/*``) allows ``action``."""
        return grant_allows_owner(self.grants, owner, action)

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "iss": self.iss,
            "aud": self.aud,
            "sub": self.sub,
            "iat": self.iat,
            "exp": self.exp,
            "jti": self.jti,
            "plt": self.plt,
            "grants": grants_to_json(self.grants),
        }
        if self.parent is not None:
            payload["parent"] = self.parent
        return payload


@dataclass(frozen=True)
class MintedToken:
    token: str
    jti: str
    exp: int
    claims: Claims


@dataclass(frozen=True)
class TokenInfo:
    """One row of the token listing. ``status``: ``active``, ``expired`` or ``revoked``."""

    jti: str
    sub: str
    parent_jti: str | None
    platform: bool
    grants: list
    issued_at: dt.datetime
    expires_at: dt.datetime
    revoked_at: dt.datetime | None
    status: str


class TokenService:
    """Everything about cap-tokens that does not speak HTTP."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        *,
        keys: KeyRing | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        self._issuer = settings.token_issuer
        self._keys = keys or KeyRing.from_settings(settings)
        self._clock = clock  # injectable so tests can move time instead of sleeping

    @property
    def keys(self) -> KeyRing:
        return self._keys

    def _now(self) -> int:
        return int(self._clock())

    # -- minting ------------------------------------------------------------------

    def mint(
        self,
        sub: str,
        grants: Iterable[object],
        ttl_s: int,
        platform: bool = False,
        parent: str | None = None,
    ) -> MintedToken:
        """Sign and record a new token for ``sub``.

        ``platform=True`` also registers ``sub`` as a platform principal (this
        is how ``cgstore token mint --platform`` creates one); ``platform=False``
        registers ``sub`` if new and never demotes an existing platform principal.
        ``parent`` links the new token under an existing one (so revoking that
        revokes this) without any subset check: that is ``attenuate``'s job.
        """
        _check_sub(sub)
        _check_ttl(ttl_s)
        parsed = parse_grants(grants)  # GrantInvalid is a BadRequest (400)
        if not isinstance(platform, bool):
            raise BadRequest("platform must be true or false")
        # Its own transaction first: a principal row is harmless to keep even
        # if recording the token then fails, and it keeps the race handling simple.
        self._upsert_principal(sub, platform, demote=False)
        with self._db.session() as session:
            if parent is not None and session.get(TokenRecord, parent) is None:
                raise NameUnknown(f"no parent token with jti {_show(parent)}")
            return self._issue(session, sub, parsed, self._now() + ttl_s, platform, parent)

    def attenuate(self, parent: Claims, grants: Iterable[object], ttl_s: int) -> MintedToken:
        """A child of ``parent``: grants a subset, ``exp`` no later than the parent's.

        Anything wider is refused with ``Denied``, never silently narrowed:
        a ttl that would outlive the parent is an error, not a clamp. ``plt``
        is inherited only if the parent has it.
        """
        _check_ttl(ttl_s)
        parsed = parse_grants(grants)  # GrantInvalid is a BadRequest (400)
        if not is_subset(parsed, parent.grants):
            raise Denied(
                "requested grants are wider than the parent token's",
                requested=grants_to_json(parsed),
                parent=grants_to_json(parent.grants),
            )
        exp = self._now() + ttl_s
        if exp > parent.exp:
            raise Denied(
                f"requested ttl_s={ttl_s} outlives the parent token "
                f"(it expires in {max(parent.exp - self._now(), 0)} s)",
                parent_exp=parent.exp,
            )
        with self._db.session() as session:
            # The parent may have been revoked since it was verified; a child
            # recorded anyway would be invalid (verify walks ancestors), but
            # refusing here gives the caller the honest answer now.
            self._check_record(session, parent.jti, parent.sub, parent.parent)
            return self._issue(session, parent.sub, parsed, exp, parent.plt, parent.jti)

    def _issue(
        self,
        session: Session,
        sub: str,
        grants: tuple[Grant, ...],
        exp: int,
        platform: bool,
        parent: str | None,
    ) -> MintedToken:
        now = self._now()
        claims = Claims(
            iss=self._issuer,
            aud=AUDIENCE,
            sub=sub,
            iat=now,
            exp=exp,
            jti=uuid.uuid4().hex,
            plt=platform,
            grants=grants,
            parent=parent,
        )
        session.add(
            TokenRecord(
                jti=claims.jti,
                sub=sub,
                parent_jti=parent,
                platform=platform,
                grants=grants_to_json(grants),
                issued_at=_to_datetime(now),
                expires_at=_to_datetime(exp),
            )
        )
        token = jwt.encode(
            claims.to_payload(),
            self._keys.signing_key,
            algorithm=ALGORITHM,
            headers={"kid": self._keys.signing_kid, "typ": "JWT"},
        )
        return MintedToken(token=token, jti=claims.jti, exp=exp, claims=claims)

    # -- verifying -----------------------------------------------------------------

    def verify(self, token: object) -> Claims:
        """The claims of a valid token, or ``TokenInvalid`` saying why not."""
        payload = self._decode(token)
        claims = self._claims_from_payload(payload)
        now = self._now()
        if now > claims.exp + LEEWAY_S:
            raise TokenInvalid(f"token expired {now - claims.exp} s ago", jti=claims.jti)
        if claims.iat > now + LEEWAY_S:
            raise TokenInvalid("token issued in the future (check clocks)", jti=claims.jti)
        if claims.exp < claims.iat:
            raise TokenInvalid("malformed token: exp before iat")
        with self._db.session() as session:
            self._check_record(session, claims.jti, claims.sub, claims.parent)
        return claims

    def _decode(self, token: object) -> dict[str, Any]:
        if not isinstance(token, str) or not token:
            raise TokenInvalid("malformed token: empty")
        if len(token) > MAX_TOKEN_LEN:
            raise TokenInvalid("malformed token: too long")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise TokenInvalid("malformed token: not a JWT") from None
        # Checked before any key is touched: "none" and HS256-with-the-public-key
        # must never reach a verifier. PyJWT's algorithms= list is the second lock.
        if header.get("alg") != ALGORITHM:
            raise TokenInvalid(f"token algorithm {_show(header.get('alg'))} not accepted (EdDSA only)")
        for key in self._candidate_keys(header):
            try:
                return jwt.decode(
                    token,
                    key,
                    algorithms=[ALGORITHM],
                    audience=AUDIENCE,
                    issuer=self._issuer,
                    # Time is judged against self._clock in verify(), not PyJWT's clock.
                    options={
                        "require": list(_REQUIRED_CLAIMS),
                        "verify_exp": False,
                        "verify_iat": False,
                        "verify_nbf": False,
                    },
                )
            except jwt.InvalidSignatureError:
                continue  # try the next key (only when the header named none)
            except jwt.InvalidAudienceError:
                raise TokenInvalid(f"token audience is not {AUDIENCE!r}") from None
            except jwt.InvalidIssuerError:
                raise TokenInvalid(f"token issuer is not {self._issuer!r}") from None
            except jwt.MissingRequiredClaimError as exc:
                raise TokenInvalid(f"malformed token: missing claim {exc.claim!r}") from None
            except jwt.PyJWTError as exc:
                raise TokenInvalid(f"malformed token: {exc}") from None
        raise TokenInvalid("token signature does not verify")

    def _candidate_keys(self, header: Mapping[str, Any]) -> list:
        kid = header.get("kid")
        if kid is None:
            return list(self._keys.verify_keys.values())
        if not isinstance(kid, str) or kid not in self._keys.verify_keys:
            raise TokenInvalid(f"token signed by an unknown key (kid {_show(kid)})")
        return [self._keys.verify_keys[kid]]

    def _claims_from_payload(self, payload: Mapping[str, Any]) -> Claims:
        sub, jti, parent = payload["sub"], payload["jti"], payload.get("parent")
        if not _valid_sub(sub):
            raise TokenInvalid("malformed token: bad sub claim")
        if not _valid_jti(jti):
            raise TokenInvalid("malformed token: bad jti claim")
        if parent is not None and not _valid_jti(parent):
            raise TokenInvalid("malformed token: bad parent claim")
        if not all(_is_int(payload[name]) for name in ("iat", "exp")):
            raise TokenInvalid("malformed token: iat and exp must be integers")
        # Re-checked exactly: PyJWT also accepts an aud list that merely contains ours,
        # and the issuer check should not depend on the installed PyJWT's version.
        if payload["aud"] != AUDIENCE:
            raise TokenInvalid(f"token audience is not {AUDIENCE!r}")
        if payload["iss"] != self._issuer:
            raise TokenInvalid(f"token issuer is not {self._issuer!r}")
        if not isinstance(payload["plt"], bool):
            raise TokenInvalid("malformed token: plt must be a boolean")
        if not isinstance(payload["grants"], list):
            raise TokenInvalid("malformed token: grants must be a list")
        try:
            grants = parse_grants(payload["grants"])
        except GrantInvalid as exc:
            raise TokenInvalid(f"malformed token: {exc.message}") from None
        return Claims(
            iss=payload["iss"],
            aud=AUDIENCE,
            sub=sub,
            iat=payload["iat"],
            exp=payload["exp"],
            jti=jti,
            plt=payload["plt"],
            grants=grants,
            parent=parent,
        )

    def _check_record(self, session: Session, jti: str, sub: str, parent: str | None) -> None:
        """The token is recorded, matches its record, and no token in its chain is revoked."""
        record = session.get(TokenRecord, jti)
        if record is None:
            raise TokenInvalid("unknown token (not issued by this store, or its record is gone)")
        if record.sub != sub or record.parent_jti != parent:
            raise TokenInvalid("token does not match its record")
        seen: set[str] = set()
        while record is not None:
            if record.revoked_at is not None:
                which = "token" if record.jti == jti else "a parent token"
                raise TokenInvalid(f"{which} was revoked", jti=jti)
            seen.add(record.jti)
            if record.parent_jti is None:
                return
            if record.parent_jti in seen or len(seen) >= MAX_CHAIN_DEPTH:
                raise TokenInvalid("token chain is corrupt")
            record = session.get(TokenRecord, record.parent_jti)
        raise TokenInvalid("a parent token is unknown")

    # -- revoking and listing --------------------------------------------------------

    def revoke(self, jti: str) -> int:
        """Revoke ``jti`` and all its descendants. Returns how many were newly revoked.

        Revoking an already revoked token is not an error (it answers 0 plus
        any descendant minted since). Unknown ``jti``: ``NameUnknown``.
        """
        now = _to_datetime(self._now())
        with self._db.session() as session:
            if not isinstance(jti, str) or session.get(TokenRecord, jti) is None:
                raise NameUnknown(f"no token with jti {_show(jti)}")
            subtree = _descendants(session, jti) | {jti}
            result = session.execute(
                update(TokenRecord)
                .where(TokenRecord.jti.in_(subtree), TokenRecord.revoked_at.is_(None))
                .values(revoked_at=now)
            )
            return result.rowcount

    def list_tokens(self, sub: str | None = None) -> list[TokenInfo]:
        """Every recorded token (optionally one principal's), oldest first, with its status.

        A token is ``revoked`` if it or any ancestor is, so the listing agrees
        with ``verify`` even for a child recorded while its parent was being revoked.
        """
        now = _to_datetime(self._now())
        with self._db.session() as session:
            query = select(TokenRecord).order_by(TokenRecord.issued_at, TokenRecord.jti)
            if sub is not None:
                # Attenuation keeps sub, so a principal's chains are all in this set.
                query = query.where(TokenRecord.sub == sub)
            records = session.scalars(query).all()
        by_jti = {r.jti: r for r in records}
        return [_token_info(r, _status(r, by_jti, now)) for r in records]

    # -- principals -------------------------------------------------------------------

    def register_principal(self, name: str, platform: bool) -> None:
        """Create or update principal ``name``; ``platform`` is set as given (may demote)."""
        _check_sub(name)
        if not isinstance(platform, bool):
            raise BadRequest("platform must be true or false")
        self._upsert_principal(name, platform, demote=True)

    def _upsert_principal(self, name: str, platform: bool, *, demote: bool) -> None:
        """Create ``name`` with ``platform``, or update an existing row.

        An existing platform principal is demoted only when ``demote`` is set:
        minting an ordinary token for it must not strip its platform status.
        Two first mints for one principal may race on the insert; the loser
        retries once and then finds the winner's row.
        """
        for attempt in range(2):
            try:
                with self._db.session() as session:
                    principal = session.get(Principal, name)
                    if principal is None:
                        session.add(Principal(name=name, platform=platform))
                    elif platform or demote:
                        principal.platform = platform
                return
            except IntegrityError:
                if attempt:
                    raise

    def is_platform_principal(self, name: str) -> bool:
        with self._db.session() as session:
            principal = session.get(Principal, name)
            return principal is not None and principal.platform

    # -- gates ------------------------------------------------------------------------

    def can_write(self, claims: Claims, owner: str, repo: str) -> None:
        """Return if ``claims`` may write ``owner/repo``; else ``Denied`` or ``RootReserved``."""
        validate_owner(owner)
        validate_repo(repo)
        allowed = claims.allows(owner, repo, WRITE)
        if is_reserved_owner(owner):
            # Three locks, all required: grant naming the owner, plt, registered platform.
            # Looked up live every time: a demoted principal loses root at once.
            if not (allowed and claims.plt and self.is_platform_principal(claims.sub)):
                raise RootReserved(
                    f"'{owner}' is a reserved namespace: only a registered platform principal, "
                    f"with a platform token and a grant naming '{owner}/...', may write there",
                    owner=owner,
                )
            return
        if not allowed:
            raise Denied(f"token grants no write on {owner}/{repo}", repo=f"{owner}/{repo}")

    def can_read(self, claims: Claims, owner: str, repo: str) -> bool:
        """Whether ``claims`` may read ``owner/repo``. ``root/*`` is public to valid tokens."""
        if owner == ROOT_OWNER:
            return True
        return claims.allows(owner, repo, READ)


# -- helpers ---------------------------------------------------------------------------


def _check_sub(sub: object) -> None:
    if not _valid_sub(sub):
        raise BadRequest(
            f"principal name must be 1-{MAX_SUB_LEN} printable characters without "
            "surrounding whitespace"
        )


def _valid_sub(sub: object) -> bool:
    return (
        isinstance(sub, str)
        and 0 < len(sub) <= MAX_SUB_LEN
        and sub.isprintable()
        and sub == sub.strip()  # "alice " and "alice" must not be two principals
    )


def _valid_jti(jti: object) -> bool:
    return isinstance(jti, str) and 0 < len(jti) <= MAX_JTI_LEN and jti.isascii() and jti.isalnum()


def _check_ttl(ttl_s: object) -> None:
    if not _is_int(ttl_s) or not 0 < ttl_s <= MAX_TTL_S:
        raise BadRequest(f"ttl_s must be an integer in 1..{MAX_TTL_S} (366 days)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _descendants(session: Session, jti: str) -> set[str]:
    found: set[str] = set()
    frontier = {jti}
    while frontier:
        children = set(
            session.scalars(select(TokenRecord.jti).where(TokenRecord.parent_jti.in_(frontier)))
        )
        frontier = children - found - {jti}
        found |= frontier
    return found


def _status(record: TokenRecord, by_jti: Mapping[str, TokenRecord], now: dt.datetime) -> str:
    node: TokenRecord | None = record
    for _ in range(MAX_CHAIN_DEPTH):
        if node is None:
            break
        if node.revoked_at is not None:
            return "revoked"
        node = by_jti.get(node.parent_jti) if node.parent_jti else None
    return "expired" if record.expires_at <= now else "active"


def _token_info(record: TokenRecord, status: str) -> TokenInfo:
    return TokenInfo(
        jti=record.jti,
        sub=record.sub,
        parent_jti=record.parent_jti,
        platform=record.platform,
        grants=record.grants,
        issued_at=record.issued_at,
        expires_at=record.expires_at,
        revoked_at=record.revoked_at,
        status=status,
    )


def _to_datetime(epoch_s: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC)


def _show(value: object) -> str:
    text = ascii(value) if isinstance(value, str) else f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."
