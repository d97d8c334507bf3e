"""Principals and owners: who exists, who is platform, and who holds which owner slug.

A principal is recorded the first time a token is minted for it (a tenant),
or registered as a platform principal (``cgstore token mint --platform``,
``POST /v1/tokens {"platform": true}``). An owner slug is claimed by the
calling principal with ``POST /v1/owners``; the reserved slugs never can be
(that refusal is ``access.can_claim_owner``'s), and a slug has one holder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from cgstore.access import can_claim_owner
from cgstore.audit.service import record, record_denial
from cgstore.core.db import Database, insert_ignoring_conflicts, utcnow
from cgstore.core.errors import BadRequest, Conflict, NameInvalid
from cgstore.owners.models import Owner, Principal
from cgstore.tokens.claims import Claims, check_sub


@dataclass(frozen=True)
class OwnerInfo:
    slug: str
    principal: str
    created_at: object


# -- principals -------------------------------------------------------------------------


def register_principal(db: Database, name: str, platform: bool, *, actor: str = "cli") -> None:
    """Create or update principal ``name``; ``platform`` is set as given (may demote). Audited.

    A demotion counts from the next request: the root gate looks it up live.
    """
    check_sub(name)
    if not isinstance(platform, bool):
        raise BadRequest("platform must be true or false")

    def change_and_audit(session: Session) -> None:
        # One transaction: the change is never visible without its audit row, nor the row without it.
        _set_principal(session, name, platform, demote=True)
        record(session, actor=actor, jti=None, action="principal.register", target=name, detail={"platform": platform})

    _retrying_first_insert(db, change_and_audit)


def upsert_principal(db: Database, name: str, platform: bool, *, demote: bool) -> None:
    """Create ``name`` with ``platform``, or update an existing row.

    An existing platform principal is demoted only when ``demote`` is set:
    minting an ordinary token for it must not strip its platform status.
    """
    _retrying_first_insert(db, lambda session: _set_principal(session, name, platform, demote=demote))


def _set_principal(session: Session, name: str, platform: bool, *, demote: bool) -> None:
    principal = session.get(Principal, name)
    if principal is None:
        session.add(Principal(name=name, platform=platform))
    elif platform or demote:
        principal.platform = platform


def _retrying_first_insert(db: Database, work: Callable[[Session], None]) -> None:
    """Run ``work(session)`` in one transaction. Two first mints for one principal may race
    on the insert; the loser retries once and then finds the winner's row."""
    for attempt in range(2):
        try:
            with db.session() as session:
                work(session)
            return
        except IntegrityError:
            if attempt:
                raise


def is_platform_principal(session: Session, name: str) -> bool:
    """Looked up live on every root write: a demoted principal loses root at once."""
    principal = session.get(Principal, name)
    return principal is not None and principal.platform


# -- owners ------------------------------------------------------------------------------


def holder(session: Session, slug: str) -> str | None:
    """The principal holding owner ``slug``, or None when nobody claimed it."""
    owner = session.get(Owner, slug)
    return owner.principal if owner is not None else None


def held_by(session: Session, principal: str, slugs: Iterable[str]) -> frozenset[str]:
    """Which of ``slugs`` ``principal`` holds (a slug's holder never changes once claimed)."""
    slugs = list(slugs)
    if not slugs:
        return frozenset()
    rows = session.scalars(select(Owner.slug).where(Owner.slug.in_(slugs), Owner.principal == principal))
    return frozenset(rows)


def claim_owner(db: Database, claims: Claims, slug: object) -> OwnerInfo:
    """Claim ``slug`` for ``claims.sub``: 201 once; 409 ``CONFLICT`` when anyone holds it already.

    A look-alike slug (400) and a taken one (409) are audited here: they are
    attempts on a name, like the 403s the error handler audits.
    """
    try:
        can_claim_owner(claims, slug).enforce()
    except NameInvalid as err:
        _audit_refused_claim(db, claims, slug, err)
        raise
    upsert_principal(db, claims.sub, False, demote=False)  # the FK target, for a sub minted elsewhere
    with db.session() as session:
        now = utcnow()
        taken = not insert_ignoring_conflicts(session, Owner, slug=slug, principal=claims.sub, created_at=now)
        if not taken:
            record(session, actor=claims.sub, jti=claims.jti, action="owner.claim", target=str(slug))
    if taken:
        err = Conflict(f"owner {slug!r} is already taken", owner=slug)
        _audit_refused_claim(db, claims, slug, err)
        raise err
    return OwnerInfo(slug=str(slug), principal=claims.sub, created_at=now)


def _audit_refused_claim(db: Database, claims: Claims, slug: object, err: Conflict | NameInvalid) -> None:
    # The audit escapes every non-ASCII and control character: the row shows exactly what was tried.
    shown = slug if isinstance(slug, str) else f"<{type(slug).__name__}>"
    record_denial(
        db,
        actor=claims.sub,
        jti=claims.jti,
        action="owner.claim",
        target=shown,
        outcome=err.code,
        detail={"message": err.message},
    )
