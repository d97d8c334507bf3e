"""Cap-tokens: issuance (mint, attenuate), verification, revocation and listing.

A cap-token is an EdDSA (Ed25519) JWT signed by the key ring (tokens/ring.py).
Its claims (docs/protocol.md, "Tokens"): ``iss``, ``aud`` = ``cgstore``, ``sub``
(principal), ``iat``, ``exp``, ``jti``, ``plt`` (platform), ``grants``, and
``parent`` (jti) when attenuated; ``nbf`` is honoured when present.

A signature alone never makes a token valid. ``verify`` requires: the header's
``alg`` EdDSA, ``typ`` ``JWT`` (a publish receipt, signed by the same ring,
never passes for a token) and a ``kid`` naming a key of the ring that is not retired; the
signature; ``aud`` and ``iss`` exactly; ``exp``, ``iat`` and ``nbf`` against the
clock; a record for the ``jti`` whose digest of the claims equals the digest
of the presented claims (so a recorded jti re-signed with other claims by any
accepted key is refused) and whose signing ``kid`` is the header's; and
neither the token nor any ancestor revoked.
Nothing the database says is cached between calls (one statement reads the
key's row, the record and its ancestors on every verification), so a
revocation or a key retirement takes effect on the very next request. Every failure is ``TokenInvalid`` (401); no
path falls back to anonymous. Tokens are never stored or logged: records hold
claims and the jti.

What a token may do is decided in ``cgstore.access``, not here. Every mint,
attenuation and revocation is audited in its own transaction.
"""

from __future__ import annotations

import datetime as dt
import hmac
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jwt
from sqlalchemy import ColumnElement, and_, or_, select, text, update
from sqlalchemy.orm import Session

from cgstore.access import can_attenuate
from cgstore.audit.service import record
from cgstore.core.db import Database
from cgstore.core.errors import BadRequest, NameUnknown, TokenInvalid
from cgstore.owners.service import held_by, upsert_principal
from cgstore.settings import Settings
from cgstore.tokens.claims import (
    ALGORITHM,
    AUDIENCE,
    TOKEN_TYP,
    Claims,
    check_sub,
    check_ttl,
    claims_digest,
    is_int,
    valid_jti,
    valid_sub,
)
from cgstore.tokens.grants import Grant, GrantInvalid, grants_to_json, literal_owners, parse_grants
from cgstore.tokens.models import TokenRecord
from cgstore.tokens.ring import KID_LEN, KeyRing, KeyRow
from cgstore_client.receipts import RECEIPT_TYP
from cgstore_client.wire.tokens import DEFAULT_TOKEN_PAGE, MAX_TOKEN_PAGE

# Clock skew tolerated between this process and whoever judges "now" elsewhere.
LEEWAY_S = 10
# A token longer than this is garbage (64 grants fit in well under 16 KiB).
MAX_TOKEN_LEN = 16 * 1024
# Attenuation chains are short in practice (platform job → mint child); a
# longer walk means a corrupt table, and a bound keeps verify cheap regardless.
MAX_CHAIN_DEPTH = 32

_REQUIRED_CLAIMS = ("iss", "aud", "sub", "iat", "exp", "jti", "plt", "grants")


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


@dataclass(frozen=True)
class TokenPage:
    """One page of the token listing; ``next_cursor`` is None on the last page."""

    tokens: list[TokenInfo]
    next_cursor: str | None


class TokenService:
    """Everything about cap-tokens that does not speak HTTP."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        *,
        ring: KeyRing | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        self._issuer = settings.token_issuer
        self._keys = ring or KeyRing(db, settings)
        self._clock = clock  # injectable so tests can move time instead of sleeping

    @property
    def ring(self) -> KeyRing:
        return self._keys

    @property
    def db(self) -> Database:
        return self._db

    def now(self) -> int:
        return int(self._clock())

    # -- minting ------------------------------------------------------------------

    def mint(
        self,
        sub: str,
        grants: Iterable[object],
        ttl_s: int,
        platform: bool = False,
        *,
        actor: Claims | None = None,
    ) -> MintedToken:
        """Sign and record a new token for ``sub``; ``actor`` is the admin asking (None: the CLI).

        ``platform=True`` also registers ``sub`` as a platform principal (this
        is how ``cgstore token mint --platform`` creates one); ``platform=False``
        registers ``sub`` if new and never demotes an existing platform principal.
        """
        check_sub(sub)
        check_ttl(ttl_s)
        parsed = parse_grants(grants)  # GrantInvalid is a BadRequest (400)
        if not isinstance(platform, bool):
            raise BadRequest("platform must be true or false")
        # Its own transaction first: a principal row is harmless to keep even
        # if recording the token then fails, and it keeps the race handling simple.
        upsert_principal(self._db, sub, platform, demote=False)
        with self._db.session() as session:
            minted = self._issue(session, sub, parsed, self.now() + ttl_s, platform, None)
            _audit(session, actor, "token.mint", minted, platform=platform)
            return minted

    def attenuate(
        self, parent: Claims, grants: Iterable[object], ttl_s: int, platform: bool | None = None
    ) -> MintedToken:
        """A child of ``parent``: grants a subset, ``exp`` no later than the parent's.

        Anything wider is refused with ``Denied`` naming what was wider, never
        silently narrowed: a ttl that would outlive the parent is an error, not
        a clamp. ``platform`` None inherits the parent's ``plt``; True asks for
        it (refused unless the parent has it); False drops it.
        """
        check_ttl(ttl_s)
        parsed = parse_grants(grants)  # GrantInvalid is a BadRequest (400)
        if platform is not None and not isinstance(platform, bool):
            raise BadRequest("platform must be true, false or absent")
        plt = parent.plt if platform is None else platform
        exp = self.now() + ttl_s
        with self._db.session() as session:
            held = held_by(session, parent.sub, literal_owners(parsed))
        can_attenuate(parent, parsed, exp=exp, plt=plt, held_owners=held).enforce()
        with self._db.session() as session:
            # The parent may have been revoked since it was verified; a child
            # recorded anyway would be invalid (verify walks ancestors), but
            # refusing here gives the caller the honest answer now.
            if self._check_chain(session, parent.jti) >= MAX_CHAIN_DEPTH:
                raise BadRequest(
                    f"the parent token is already at the chain depth limit ({MAX_CHAIN_DEPTH} tokens): "
                    "a child of it would never verify",
                    max_chain_depth=MAX_CHAIN_DEPTH,
                )
            minted = self._issue(session, parent.sub, parsed, exp, plt, parent.jti)
            _audit(session, parent, "token.attenuate", minted, parent=parent.jti)
            return minted

    def _issue(
        self,
        session: Session,
        sub: str,
        grants: tuple[Grant, ...],
        exp: int,
        platform: bool,
        parent: str | None,
    ) -> MintedToken:
        now = self.now()
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
        payload = claims.to_payload()
        kid, signing_key = self._keys.signing_key(session)
        session.add(
            TokenRecord(
                jti=claims.jti,
                sub=sub,
                parent_jti=parent,
                platform=platform,
                grants=grants_to_json(grants),
                issued_at=_to_datetime(now),
                expires_at=_to_datetime(exp),
                claims_digest=claims_digest(payload),
                kid=kid,
            )
        )
        token = jwt.encode(payload, signing_key, algorithm=ALGORITHM, headers={"kid": kid, "typ": TOKEN_TYP})
        return MintedToken(token=token, jti=claims.jti, exp=exp, claims=claims)

    # -- verifying -----------------------------------------------------------------

    def verify(self, token: object) -> Claims:
        """The claims of a valid token, or ``TokenInvalid`` saying why not.

        One statement reads everything the database says about the token (its
        key's row, its record and its ancestors'), on an autocommit connection:
        a verification is one round trip, not a transaction of four.
        """
        kid = self._header_kid(token)
        with self._db.reading() as conn:
            rows = conn.execute(
                _VERIFY_STATEMENT, {"kid": kid, "jti": _unverified_jti(token), "depth": MAX_CHAIN_DEPTH}
            ).all()
        key_row = KeyRow(kid, rows[0].public_key, rows[0].retired_at) if rows[0].public_key is not None else None
        payload = self._decode(token, self._keys.verify_key(kid, key_row))
        claims = self._claims_from_payload(payload)
        self._check_times(claims, payload)
        chain = [row for row in rows if row.jti is not None]
        if not chain or chain[0].jti != claims.jti:
            raise TokenInvalid("unknown token (not issued by this store, or its record is gone)")
        record_ = chain[0]
        if record_.claims_digest is None:
            raise TokenInvalid("token predates claim digests (revision 0002): mint a new one", jti=claims.jti)
        if not hmac.compare_digest(record_.claims_digest, claims_digest(payload)):
            raise TokenInvalid("token claims differ from its record", jti=claims.jti)
        if record_.kid != kid:  # so a retired key's tokens stay dead, even re-signed
            raise TokenInvalid("token signed by another key than the one that minted it", jti=claims.jti)
        _check_chain_rows(chain, claims.jti)
        return claims

    @staticmethod
    def _header_kid(token: object) -> str:
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
        kid = header.get("kid")
        if not isinstance(kid, str) or len(kid) != KID_LEN or not all(c in "0123456789abcdef" for c in kid):
            raise TokenInvalid(f"token signed by an unknown key (kid {_show(kid)})")
        # The same keys sign publish receipts: only a cap-token's typ authenticates.
        if header.get("typ") == RECEIPT_TYP:
            raise TokenInvalid("a publish receipt is not a cap-token")
        if header.get("typ") != TOKEN_TYP:
            raise TokenInvalid(f"token type {_show(header.get('typ'))} not accepted ({TOKEN_TYP} only)")
        return kid

    def _decode(self, token: str, key) -> dict[str, Any]:
        try:
            return jwt.decode(
                token,
                key,
                algorithms=[ALGORITHM],
                audience=AUDIENCE,
                issuer=self._issuer,
                # Time is judged against self._clock in _check_times, not PyJWT's clock.
                options={
                    "require": list(_REQUIRED_CLAIMS),
                    "verify_exp": False,
                    "verify_iat": False,
                    "verify_nbf": False,
                },
            )
        except jwt.InvalidSignatureError:
            raise TokenInvalid("token signature does not verify") from None
        except jwt.InvalidAudienceError:
            raise TokenInvalid(f"token audience is not {AUDIENCE!r}") from None
        except jwt.InvalidIssuerError:
            raise TokenInvalid(f"token issuer is not {self._issuer!r}") from None
        except jwt.MissingRequiredClaimError as exc:
            raise TokenInvalid(f"malformed token: missing claim {exc.claim!r}") from None
        except jwt.PyJWTError as exc:
            raise TokenInvalid(f"malformed token: {exc}") from None

    def _check_times(self, claims: Claims, payload: Mapping[str, Any]) -> None:
        now = self.now()
        if now > claims.exp + LEEWAY_S:
            raise TokenInvalid(f"token expired {now - claims.exp} s ago", jti=claims.jti)
        if claims.iat > now + LEEWAY_S:
            raise TokenInvalid("token issued in the future (check clocks)", jti=claims.jti)
        if claims.exp < claims.iat:
            raise TokenInvalid("malformed token: exp before iat")
        nbf = payload.get("nbf")
        if nbf is not None and not is_int(nbf):
            raise TokenInvalid("malformed token: nbf must be an integer")
        if nbf is not None and nbf > now + LEEWAY_S:
            raise TokenInvalid(f"token not yet valid (nbf is {nbf - now} s from now)", jti=claims.jti)

    def _claims_from_payload(self, payload: Mapping[str, Any]) -> Claims:
        sub, jti, parent = payload["sub"], payload["jti"], payload.get("parent")
        if not valid_sub(sub):
            raise TokenInvalid("malformed token: bad sub claim")
        if not valid_jti(jti):
            raise TokenInvalid("malformed token: bad jti claim")
        if parent is not None and not valid_jti(parent):
            raise TokenInvalid("malformed token: bad parent claim")
        if not all(is_int(payload[name]) for name in ("iat", "exp")):
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

    @staticmethod
    def _check_chain(session: Session, jti: str) -> int:
        """The token is recorded and no token in its chain is revoked (``_check_chain_rows``).

        Returns the chain's length (the token and its ancestors).
        """
        chain: list[TokenRecord] = []
        record_ = session.get(TokenRecord, jti)
        while record_ is not None and len(chain) <= MAX_CHAIN_DEPTH:
            chain.append(record_)
            if record_.parent_jti is None or any(member.jti == record_.parent_jti for member in chain):
                break  # the root, or a cycle _check_chain_rows names
            record_ = session.get(TokenRecord, record_.parent_jti)
        if not chain:
            raise TokenInvalid("unknown token (not issued by this store, or its record is gone)")
        _check_chain_rows(chain, jti)
        return len(chain)

    # -- revoking and listing --------------------------------------------------------

    def revoke(self, jti: str, *, actor: Claims | None = None) -> int:
        """Revoke ``jti`` and all its descendants. Returns how many were newly revoked.

        Revoking an already revoked token is not an error (it answers 0 plus
        any descendant minted since). Unknown ``jti``: ``NameUnknown``.
        """
        now = _to_datetime(self.now())
        with self._db.session() as session:
            if not valid_jti(jti) or session.get(TokenRecord, jti) is None:
                raise NameUnknown(f"no token with jti {_show(jti)}")
            subtree = _descendants(session, jti) | {jti}
            result = session.execute(
                update(TokenRecord)
                .where(TokenRecord.jti.in_(subtree), TokenRecord.revoked_at.is_(None))
                .values(revoked_at=now)
            )
            record(
                session,
                actor=actor.sub if actor else "cli",
                jti=actor.jti if actor else None,
                action="token.revoke",
                target=jti,
                detail={"revoked": result.rowcount},
            )
            return result.rowcount

    def list_tokens(
        self, sub: str | None = None, *, cursor: str | None = None, limit: int = DEFAULT_TOKEN_PAGE
    ) -> TokenPage:
        """One page of recorded tokens (optionally one principal's), oldest first, with their status.

        Keyset-paginated by ``(issued_at, jti)``: ``cursor`` is the last jti of
        the previous page (tokens are never deleted, so it stays a valid mark).
        A token is ``revoked`` if it or any ancestor is, so the listing agrees
        with ``verify`` even for a child recorded while its parent was being revoked.
        """
        limit = max(1, min(limit, MAX_TOKEN_PAGE))
        now = _to_datetime(self.now())
        with self._db.session() as session:
            query = select(TokenRecord).order_by(TokenRecord.issued_at, TokenRecord.jti)
            if sub is not None:
                # Attenuation keeps sub, so a principal's chains are all in this set.
                query = query.where(TokenRecord.sub == sub)
            if cursor is not None:
                query = query.where(_after(session, cursor))
            # limit + 1: the extra row only tells whether a next page exists.
            records = session.scalars(query.limit(limit + 1)).all()
            page, more = records[:limit], len(records) > limit
            by_jti = {r.jti: r for r in page}
            # A page may lack an ancestor; _status fetches the missing ones for its walk.
            return TokenPage(
                tokens=[_token_info(r, _status(session, r, by_jti, now)) for r in page],
                next_cursor=page[-1].jti if more else None,
            )

    def chains(self, jtis: Iterable[str]) -> dict[str, list[str]]:
        """Each token's ancestors, parent first, as recorded (a listing shows them; never a token value).

        Read one generation at a time, each a single query, at most ``MAX_CHAIN_DEPTH`` of them.
        """
        jtis = list(jtis)
        parents: dict[str, str | None] = {}
        frontier = set(jtis)
        with self._db.session() as session:
            for _ in range(MAX_CHAIN_DEPTH):
                frontier -= parents.keys()
                if not frontier:
                    break
                rows = session.execute(
                    select(TokenRecord.jti, TokenRecord.parent_jti).where(TokenRecord.jti.in_(frontier))
                ).all()
                parents.update({jti: None for jti in frontier})  # an unrecorded jti ends its chain
                parents.update({jti: parent for jti, parent in rows})
                frontier = {parent for _, parent in rows if parent}
        chains: dict[str, list[str]] = {}
        for jti in jtis:
            chain, node = [], parents.get(jti)
            while node is not None and node not in chain and len(chain) < MAX_CHAIN_DEPTH:
                chain.append(node)
                node = parents.get(node)
            chains[jti] = chain
        return chains


# -- helpers ---------------------------------------------------------------------------


def _audit(session: Session, actor: Claims | None, action: str, minted: MintedToken, **detail: Any) -> None:
    """The jti and claims of the new token; never the token itself."""
    record(
        session,
        actor=actor.sub if actor else "cli",
        jti=actor.jti if actor else None,
        action=action,
        target=minted.jti,
        detail={"sub": minted.claims.sub, "grants": grants_to_json(minted.claims.grants), "exp": minted.exp, **detail},
    )


# The header kid's key row, LEFT JOINed to the token's record and its ancestors
# (nearest first; ``depth`` bounds a corrupt, cyclic chain): one row per chain
# member, or one row of NULLs when the jti is not recorded.
_VERIFY_STATEMENT = text(
    """
    WITH RECURSIVE chain (jti, parent_jti, revoked_at, claims_digest, kid, depth) AS (
        SELECT jti, parent_jti, revoked_at, claims_digest, kid, 0 FROM tokens WHERE jti = :jti
        UNION ALL
        SELECT t.jti, t.parent_jti, t.revoked_at, t.claims_digest, t.kid, chain.depth + 1
        FROM tokens t JOIN chain ON t.jti = chain.parent_jti
        WHERE chain.depth < :depth
    )
    SELECT k.public_key, k.retired_at, chain.jti, chain.parent_jti, chain.revoked_at, chain.claims_digest,
           chain.kid, chain.depth
    FROM (SELECT CAST(:kid AS VARCHAR(16)) AS kid) AS header
    LEFT JOIN signing_keys k ON k.kid = header.kid
    LEFT JOIN chain ON 1 = 1
    ORDER BY chain.depth
    """
)


def _unverified_jti(token: str) -> str:
    """The jti the token claims, to fetch its record with its key; trusted only once the signature verifies."""
    try:
        jti = jwt.decode(token, options={"verify_signature": False}).get("jti")
    except jwt.PyJWTError:
        return ""
    return jti if valid_jti(jti) else ""


def _check_chain_rows(chain: list, jti: str) -> None:
    """No token of the chain (the token, then its ancestors nearest first) is revoked, and the chain is whole."""
    seen: set[str] = set()
    for depth, member in enumerate(chain):
        if member.revoked_at is not None:
            which = "token" if member.jti == jti else "a parent token"
            raise TokenInvalid(f"{which} was revoked", jti=jti)
        seen.add(member.jti)
        if member.parent_jti is None:
            return
        if member.parent_jti in seen or len(seen) >= MAX_CHAIN_DEPTH:
            raise TokenInvalid("token chain is corrupt")
        if depth + 1 == len(chain) or chain[depth + 1].jti != member.parent_jti:
            raise TokenInvalid("a parent token is unknown")


def _after(session: Session, cursor: str) -> ColumnElement[bool]:
    """Tokens listed after the one ``cursor`` names, in the listing's ``(issued_at, jti)`` order."""
    issued_at = (
        session.scalar(select(TokenRecord.issued_at).where(TokenRecord.jti == cursor)) if valid_jti(cursor) else None
    )
    if issued_at is None:
        raise BadRequest("cursor is not one this store handed out", cursor=cursor[:64])
    return or_(TokenRecord.issued_at > issued_at, and_(TokenRecord.issued_at == issued_at, TokenRecord.jti > cursor))


def _descendants(session: Session, jti: str) -> set[str]:
    found: set[str] = set()
    frontier = {jti}
    while frontier:
        children = set(session.scalars(select(TokenRecord.jti).where(TokenRecord.parent_jti.in_(frontier))))
        frontier = children - found - {jti}
        found |= frontier
    return found


def _status(session: Session, record_: TokenRecord, by_jti: dict[str, TokenRecord], now: dt.datetime) -> str:
    node: TokenRecord | None = record_
    for _ in range(MAX_CHAIN_DEPTH):
        if node is None:
            break
        if node.revoked_at is not None:
            return "revoked"
        if not node.parent_jti:
            break
        node = by_jti.get(node.parent_jti) or session.get(TokenRecord, node.parent_jti)
    return "expired" if record_.expires_at <= now else "active"


def _token_info(record_: TokenRecord, status: str) -> TokenInfo:
    return TokenInfo(
        jti=record_.jti,
        sub=record_.sub,
        parent_jti=record_.parent_jti,
        platform=record_.platform,
        grants=record_.grants,
        issued_at=record_.issued_at,
        expires_at=record_.expires_at,
        revoked_at=record_.revoked_at,
        status=status,
    )


def _to_datetime(epoch_s: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC)


def _show(value: object) -> str:
    text = ascii(value) if isinstance(value, str) else f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."
