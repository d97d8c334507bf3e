"""Mint claims: one worker of a fleet compiles a declaration, the others wait for its record.

``claim`` answers, in this order: a refused gate (the publish gates, with the
claim's TTL as the preflight's token lifetime: ``access.can_claim``);
``published`` when discover (``search.candidates``, the same search) already
finds a live record the caller may read; otherwise the declaration's slot
(``models.py``) decides under its row lock: ``held`` by a live claim,
``failing`` after ``FAILING_AFTER`` failures or expiries in a row,
``backoff`` until the retry time a failed release set, else ``granted``.

A claim that was not beaten within its TTL is taken over by the next claimer
at once (a crashed mint must not hold the fleet back) but counts as a failure,
so a declaration whose every mint crashes becomes ``failing`` as one whose every
mint fails does. Only a publish clears the count; an admin clears ``failing``.

Why a row lock and not a conditional UPDATE (as ``operations/leases.py``): the
answer depends on several columns at once (holder, expiry, retry time, failing)
and writes an audit entry per change. ``SELECT … FOR UPDATE`` after the
slot's ``INSERT … ON CONFLICT DO NOTHING`` serializes the claimers of one
declaration on PostgreSQL across replicas; on SQLite that INSERT already took
the database's one write lock. Either way the decision runs alone.

Lock order, everywhere: the slot's row, then the audit chain's head (``audit``
appends last). The repo a first claim needs is created in its own transaction
before, never while a slot is locked.
"""

from __future__ import annotations

import datetime as dt
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from cgstore import access
from cgstore.audit.service import record as audit
from cgstore.claims.models import DeclarationClaim
from cgstore.compiled_graphs import search
from cgstore.compiled_graphs.models import CompiledGraph
from cgstore.context import StoreContext
from cgstore.core.db import Database, insert_ignoring_conflicts, utcnow
from cgstore.core.errors import KeyInvalid, NameUnknown, hidden_miss
from cgstore.core.names import validate_owner, validate_repo
from cgstore.repos.models import Repo
from cgstore.repos.service import ensure_repo, find_repo, write_decision
from cgstore.tokens.claims import Claims
from cgstore_client.keys import is_key
from cgstore_client.wire.fleet import (
    MAX_CLAIM_CHARS,
    ClaimBackoff,
    ClaimFailing,
    ClaimGranted,
    ClaimHeartbeat,
    ClaimHeld,
    ClaimPublished,
    ClaimReleased,
    ClaimRequest,
    ReleaseFailed,
    ReleasePublished,
)
from cgstore_client.wire.records import MAX_REASON_CHARS

ACTION_GRANT = "compiled_graph.claim.grant"
ACTION_RELEASE = "compiled_graph.claim.release"
ACTION_EXPIRE = "compiled_graph.claim.expire"
ACTION_CLEAR = "compiled_graph.claim.clear"

#: Failures or expiries in a row after which a declaration is ``failing`` (no grant until cleared).
FAILING_AFTER = 5
#: The longest backoff after a failed mint, however many failed before.
MAX_BACKOFF_S = 3600.0
#: The reason a lapsed claim leaves.
EXPIRED = "expired"
#: What the store writes as a claim id (``secrets.token_urlsafe``); anything else is an unknown claim.
_CLAIM_ID = re.compile(rf"^[A-Za-z0-9_-]{{1,{MAX_CLAIM_CHARS}}}$")

ClaimAnswer = ClaimGranted | ClaimHeld | ClaimPublished | ClaimBackoff | ClaimFailing


def claim(ctx: StoreContext, claims: Claims, owner: str, repo: str, request: ClaimRequest) -> ClaimAnswer:
    """Claim the mint of ``request`` in ``owner/repo`` for ``claims``' principal (see the module docstring)."""
    _, digest = search.check_declaration(request)
    with ctx.db.session() as session:
        write = write_decision(session, claims, owner, repo)
    access.can_claim(claims, write, now=ctx.tokens.now(), ttl_s=ctx.settings.claim_ttl_s).enforce()
    found = search.candidates(ctx, claims, request, search.download_urls(ctx))
    if found:
        answer: ClaimAnswer = ClaimPublished.model_validate({"candidates": found})
    else:
        answer = _claim_slot(ctx, claims, _repo_for_claims(ctx.db, claims, owner, repo), request, digest)
    ctx.metrics.claims.labels(answer.state).inc()
    return answer


def _repo_for_claims(db: Database, claims: Claims, owner: str, repo: str) -> Repo:
    """The repo, created (visibility ``owner``, audited) by the first claim there: the claim's slot links to it.

    In its own transaction, before any slot is locked (the module's lock order).
    """
    with db.session() as session:
        return find_repo(session, owner, repo) or ensure_repo(session, claims, owner, repo)


def _identity(target: Repo, claims: Claims, request: ClaimRequest, digest: str) -> dict:
    return {
        "repo_id": target.id,
        "discovery_digest": digest,
        "binding_signature": request.binding_signature or "",
        "release": request.release or "",
        # Claims follow record visibility: in a private cache each principal's are its own.
        "scope": access.private_reader(claims, target.visibility) or "",
    }


def _claim_slot(ctx: StoreContext, claims: Claims, target: Repo, request: ClaimRequest, digest: str) -> ClaimAnswer:
    identity = _identity(target, claims, request, digest)
    with ctx.db.session() as session:
        # The write first: two replicas creating one slot leave one row, and on SQLite this takes the write lock.
        insert_ignoring_conflicts(
            session, DeclarationClaim, **identity, family=request.family, sm=request.sm, failures=0, updated_at=utcnow()
        )
        slot = session.scalars(select(DeclarationClaim).filter_by(**identity).with_for_update()).one()
        now = utcnow()  # read after the lock: waiting for it takes time
        return _decide(ctx, session, claims, f"{target.owner}/{target.name}", slot, now)


def _decide(
    ctx: StoreContext, session: Session, claims: Claims, repo_name: str, slot: DeclarationClaim, now: dt.datetime
) -> ClaimAnswer:
    if slot.claim is not None and slot.expires_at > now:
        return ClaimHeld(claim=slot.claim, since=slot.granted_at, expires_at=slot.expires_at)
    if slot.claim is not None:
        _expire(ctx, session, repo_name, slot, now, noticed_by=claims.sub)
    if slot.failing_since is not None:
        return ClaimFailing(failures=slot.failures, since=slot.failing_since, reason=slot.reason)
    if slot.retry_at is not None and slot.retry_at > now:
        return ClaimBackoff(retry_at=slot.retry_at, failures=slot.failures, reason=slot.reason)
    ttl = ctx.settings.claim_ttl_s
    slot.claim = secrets.token_urlsafe(24)
    slot.holder, slot.granted_at, slot.expires_at = claims.sub, now, now + dt.timedelta(seconds=ttl)
    slot.retry_at, slot.updated_at = None, now
    session.flush()
    audit(
        session,
        actor=claims.sub,
        jti=claims.jti,
        action=ACTION_GRANT,
        target=_target(repo_name, slot),
        repo=repo_name,
        detail={**_declaration(slot), "claim": slot.claim, "expires_at": slot.expires_at.isoformat()},
    )
    return ClaimGranted(claim=slot.claim, expires_at=slot.expires_at, heartbeat_s=ttl / 3)


def _expire(
    ctx: StoreContext, session: Session, repo_name: str, slot: DeclarationClaim, now: dt.datetime, *, noticed_by: str
) -> None:
    """End a lapsed claim (its mint crashed or hung): one more failure in a row; audited under its holder."""
    holder, lapsed = slot.holder, slot.claim
    _fail(ctx, slot, EXPIRED, now, backoff=False)
    session.flush()
    ctx.metrics.claims.labels("expired").inc()
    audit(
        session,
        actor=holder or "",
        jti=None,
        action=ACTION_EXPIRE,
        target=_target(repo_name, slot),
        repo=repo_name,
        detail={**_declaration(slot), "claim": lapsed, "failures": slot.failures, "noticed_by": noticed_by},
    )


def _fail(ctx: StoreContext, slot: DeclarationClaim, reason: str, now: dt.datetime, *, backoff: bool) -> None:
    """End the slot's claim as a failure: ``failing`` at the limit, else (after a failed release) a backoff.

    An expiry is taken over at once (``backoff=False``): the claimer that noticed
    it is the next mint, and waiting would only delay the fleet's compile.
    """
    _end(slot, now)
    slot.failures += 1
    slot.reason = reason[:MAX_REASON_CHARS]
    if slot.failures >= FAILING_AFTER:
        slot.failing_since = now
    elif backoff:
        delay = min(ctx.settings.claim_backoff_s * 2 ** (slot.failures - 1), MAX_BACKOFF_S)
        slot.retry_at = now + dt.timedelta(seconds=delay)


def _end(slot: DeclarationClaim, now: dt.datetime) -> None:
    slot.claim = slot.holder = slot.granted_at = slot.expires_at = None
    slot.updated_at = now


def _published(slot: DeclarationClaim, now: dt.datetime) -> None:
    """A mint of the declaration landed: the failure history is over."""
    _end(slot, now)
    slot.failures, slot.reason, slot.retry_at, slot.failing_since = 0, None, None, None


def _target(repo_name: str, slot: DeclarationClaim) -> str:
    return f"{repo_name}:{slot.discovery_digest}"


def _declaration(slot: DeclarationClaim) -> dict:
    """The declaration as audit entries name it (the digest is what discover and claims match on)."""
    return {
        "discovery_digest": slot.discovery_digest,
        "family": slot.family,
        "sm": slot.sm,
        "binding_signature": slot.binding_signature or None,
        "release": slot.release or None,
    }


# -- the holder's calls -----------------------------------------------------------------


def heartbeat(ctx: StoreContext, claims: Claims, owner: str, repo: str, claim_id: str) -> ClaimHeartbeat:
    """Push the claim's expiry one TTL from now.

    A beat that arrives after the expiry still counts while nobody took the
    claim over (as a lease's renewal does): the mint was slow, not gone.
    """
    with ctx.db.session() as session:
        slot = _held_slot(session, claims, owner, repo, claim_id)
        now = utcnow()
        slot.expires_at = now + dt.timedelta(seconds=ctx.settings.claim_ttl_s)
        slot.updated_at = now
        return ClaimHeartbeat(claim=claim_id, expires_at=slot.expires_at)


def release(
    ctx: StoreContext,
    claims: Claims,
    owner: str,
    repo: str,
    claim_id: str,
    outcome: ReleasePublished | ReleaseFailed,
) -> ClaimReleased:
    """End the claim: ``published`` (the failure count starts over) or ``failed`` (the next grant backs off)."""
    if isinstance(outcome, ReleasePublished) and not is_key(outcome.key):
        raise KeyInvalid("not a valid key", key=outcome.key[:120])
    with ctx.db.session() as session:
        slot = _held_slot(session, claims, owner, repo, claim_id)
        now = utcnow()
        declaration = _declaration(slot)
        if isinstance(outcome, ReleasePublished):
            _published(slot, now)
            detail = {"outcome": outcome.outcome, "key": outcome.key}
        else:
            _fail(ctx, slot, outcome.reason, now, backoff=True)
            detail = {"outcome": outcome.outcome, "reason": slot.reason, "failures": slot.failures}
        session.flush()
        repo_name = f"{owner}/{repo}"
        audit(
            session,
            actor=claims.sub,
            jti=claims.jti,
            action=ACTION_RELEASE,
            target=_target(repo_name, slot),
            repo=repo_name,
            detail={**declaration, "claim": claim_id, **detail},
        )
    ctx.metrics.claims.labels(f"released_{outcome.outcome}").inc()
    return ClaimReleased(claim=claim_id, outcome=outcome.outcome)


def _held_slot(session: Session, claims: Claims, owner: str, repo: str, claim_id: str) -> DeclarationClaim:
    """The slot of ``claim_id`` in ``owner/repo``, locked, if ``claims``' principal holds it.

    Unknown, ended, taken over, in another repo, or another principal's: the
    same 404 (the last audited as a denial), so a claim id tells nobody else anything.
    """
    validate_owner(owner)
    validate_repo(repo)
    unknown = {"message": "no such claim", "claim": claim_id[:MAX_CLAIM_CHARS]}
    if not _CLAIM_ID.match(claim_id):
        raise NameUnknown(**unknown)
    found = session.execute(
        select(DeclarationClaim, Repo.owner, Repo.name)
        .join(Repo, Repo.id == DeclarationClaim.repo_id)
        .where(DeclarationClaim.claim == claim_id)
        .with_for_update(of=DeclarationClaim)
    ).first()
    if found is None or (found.owner, found.name) != (owner, repo):
        raise NameUnknown(**unknown)
    slot = found[0]
    if not access.holds_claim(claims, slot.holder):
        raise hidden_miss(NameUnknown, **unknown)
    return slot


# -- a publish ends its claim -------------------------------------------------------------


def release_by_publish(ctx: StoreContext, session: Session, claims: Claims, repo_name: str, row: CompiledGraph) -> None:
    """In the transaction that created ``row``: release, as published, the claims its publisher holds for it.

    A claim matches when its declaration matches the record as discover would
    (same repo and write-once scope, discovery digest, and the binding
    signature and release it named, if it named them). Only the publisher's
    own claims: another worker's mint is not ended by someone else's record.
    """
    slots = session.scalars(
        select(DeclarationClaim)
        .where(
            DeclarationClaim.repo_id == row.repo_id,
            DeclarationClaim.scope == row.scope,
            DeclarationClaim.discovery_digest == row.discovery_digest,
            DeclarationClaim.binding_signature.in_(["", row.binding_signature or ""]),
            DeclarationClaim.release.in_(["", row.release or ""]),
            DeclarationClaim.holder == claims.sub,
            DeclarationClaim.claim.is_not(None),
        )
        .order_by(DeclarationClaim.id)
        .with_for_update()
    ).all()
    now = utcnow()
    for slot in slots:
        claim_id = slot.claim
        _published(slot, now)
        session.flush()
        audit(
            session,
            actor=claims.sub,
            jti=claims.jti,
            action=ACTION_RELEASE,
            target=_target(repo_name, slot),
            repo=repo_name,
            detail={**_declaration(slot), "claim": claim_id, "outcome": "published", "key": row.key, "by": "publish"},
        )
        ctx.metrics.claims.labels("released_published").inc()


# -- what admins see and do -----------------------------------------------------------------


@dataclass(frozen=True)
class SlotView:
    """A claimed declaration as the console and ``cgstore claims`` show it."""

    id: int
    repo: str
    private: bool
    family: str
    sm: str
    discovery_digest: str
    binding_signature: str | None
    release: str | None
    claim: str | None
    holder: str | None
    granted_at: dt.datetime | None
    expires_at: dt.datetime | None
    failures: int
    reason: str | None
    retry_at: dt.datetime | None
    failing_since: dt.datetime | None


def in_flight(session: Session, limit: int) -> list[SlotView]:
    """Declarations being minted now (a claim held, expired or not), oldest grant first."""
    return _views(session, DeclarationClaim.claim.is_not(None), DeclarationClaim.granted_at, limit)


def failing(session: Session, limit: int) -> list[SlotView]:
    """Declarations no claim is granted for until cleared, longest failing first."""
    return _views(session, DeclarationClaim.failing_since.is_not(None), DeclarationClaim.failing_since, limit)


def _views(session: Session, where, order, limit: int) -> list[SlotView]:
    rows = session.execute(
        select(DeclarationClaim, Repo.owner, Repo.name)
        .join(Repo, Repo.id == DeclarationClaim.repo_id)
        .where(where)
        .order_by(order, DeclarationClaim.id)
        .limit(limit)
    ).all()
    return [
        SlotView(
            id=slot.id,
            repo=f"{owner}/{name}",
            private=slot.scope != "",
            family=slot.family,
            sm=slot.sm,
            discovery_digest=slot.discovery_digest,
            binding_signature=slot.binding_signature or None,
            release=slot.release or None,
            claim=slot.claim,
            holder=slot.holder,
            granted_at=slot.granted_at,
            expires_at=slot.expires_at,
            failures=slot.failures,
            reason=slot.reason,
            retry_at=slot.retry_at,
            failing_since=slot.failing_since,
        )
        for slot, owner, name in rows
    ]


def count_in_flight(db: Database) -> int:
    """Claims held and not expired (the ``cgstore_claims_in_flight`` gauge)."""
    with db.reading() as conn:
        return conn.execute(
            select(func.count())
            .select_from(DeclarationClaim)
            .where(DeclarationClaim.claim.is_not(None), DeclarationClaim.expires_at > utcnow())
        ).scalar_one()


def clear(db: Database, slot_id: int, *, actor: str, jti: str | None) -> SlotView:
    """Forget a declaration's failures (``failing`` and any backoff): the next claim is granted.

    ``NameUnknown`` for no such slot. A held claim is left alone: clearing
    is about the history, not about a mint running now.
    """
    with db.session() as session:
        found = session.execute(
            select(DeclarationClaim, Repo.owner, Repo.name)
            .join(Repo, Repo.id == DeclarationClaim.repo_id)
            .where(DeclarationClaim.id == slot_id)
            .with_for_update(of=DeclarationClaim)
        ).first()
        if found is None:
            raise NameUnknown("no such claimed declaration", id=slot_id)
        slot, owner, name = found
        before = {"failures": slot.failures, "reason": slot.reason}
        slot.failures, slot.reason, slot.retry_at, slot.failing_since = 0, None, None, None
        slot.updated_at = utcnow()
        session.flush()
        repo_name = f"{owner}/{name}"
        audit(
            session,
            actor=actor,
            jti=jti,
            action=ACTION_CLEAR,
            target=_target(repo_name, slot),
            repo=repo_name,
            detail={**_declaration(slot), **before},
        )
    return _views_of(db, slot_id)


def _views_of(db: Database, slot_id: int) -> SlotView:
    with db.session() as session:
        return _views(session, DeclarationClaim.id == slot_id, DeclarationClaim.id, 1)[0]


def clear_as_admin(ctx: StoreContext, claims: Claims, slot_id: int) -> SlotView:
    """``clear`` for a store admin (the console's action)."""
    access.is_admin(claims).enforce()
    return clear(ctx.db, slot_id, actor=claims.sub, jti=claims.jti)
