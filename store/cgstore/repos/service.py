"""Repos: finding them for reading and writing, creating them, changing their visibility.

The access rules are ``cgstore.access``'s; this module gathers the facts they
need (the owner's holder, the caller's platform registration) and enforces the
answer. Reads of a repo the caller may not read look exactly like reads of a
repo that does not exist (the same miss either way). Checking a write creates
nothing: a repo comes into being only with a successful write (``ensure_repo``,
called in the transaction that records that write, audited as
``repo.create``), so a refused or failed call leaves no repo behind.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from cgstore import access
from cgstore.audit.service import record
from cgstore.core.db import Database, insert_ignoring_conflicts, utcnow
from cgstore.core.errors import BadRequest, StoreError, hidden_miss
from cgstore.core.names import is_reserved_owner, validate_owner, validate_repo
from cgstore.owners.service import holder, is_platform_principal
from cgstore.repos.models import VISIBILITIES, Repo
from cgstore.tokens.claims import Claims


@dataclass(frozen=True)
class RepoInfo:
    owner: str
    name: str
    visibility: str
    created_by: str
    created_at: object
    created: bool


def find_repo(session: Session, owner: str, name: str) -> Repo | None:
    return session.scalar(select(Repo).where(Repo.owner == owner, Repo.name == name))


def readable_repo(
    session: Session,
    claims: Claims,
    owner: str,
    name: str,
    miss: type[StoreError],
    message: str,
    **detail,
) -> Repo:
    """The repo if it exists and ``claims`` may read it; otherwise ``miss(message)``.

    Both failures raise the identical error; only the unreadable one is marked
    (``hidden_miss``) so that it is audited as the denial it is.
    """
    validate_owner(owner)
    validate_repo(name)
    if not access.can_read(claims, owner, name).allowed:
        raise hidden_miss(miss, message, **detail)
    repo = find_repo(session, owner, name)
    if repo is None:
        raise miss(message, **detail)
    return repo


def write_decision(session: Session, claims: Claims, owner: str, name: str) -> access.Decision:
    """What a publish or upload by ``claims`` into ``owner/name`` would be answered (the preflight's question)."""
    validate_owner(owner)
    validate_repo(name)
    return access.can_write(claims, owner, name, **_facts(session, claims, owner))


def preflight(db: Database, claims: Claims, owner: str, name: str, min_ttl_s: int, now: int) -> None:
    """Raise what a publish into ``owner/name`` would be refused with, or a token expiring too soon."""
    with db.session() as session:
        write = write_decision(session, claims, owner, name)
    access.preflight(claims, write, now=now, min_ttl_s=min_ttl_s).enforce()


def writable_repo(session: Session, claims: Claims, owner: str, name: str) -> Repo | None:
    """The repo ``claims`` may write, or None while it does not exist yet (nothing is created)."""
    write_decision(session, claims, owner, name).enforce()
    return find_repo(session, owner, name)


def ensure_repo(session: Session, claims: Claims, owner: str, name: str) -> Repo:
    """The repo, created (visibility ``owner``) if absent: only for a write that succeeded.

    The caller has already passed ``writable_repo``; it calls this in the same
    transaction that records the write, so the repo and the write land together.
    """
    return _find_or_create(session, claims, owner, name, "owner")[0]


def configure_repo(db: Database, claims: Claims, owner: str, name: str, visibility: str) -> RepoInfo:
    """``PUT /v1/repos/{owner}/{name}``: create it with ``visibility``, or change its visibility."""
    if visibility not in VISIBILITIES:  # the wire type checks too; the service never trusts it
        raise BadRequest(f"visibility must be one of {VISIBILITIES}")
    with db.session() as session:
        validate_owner(owner)
        validate_repo(name)
        facts = _facts(session, claims, owner)
        access.can_manage_repo(claims, owner, name, **facts).enforce()
        repo, created = _find_or_create(session, claims, owner, name, visibility)
        if not created and repo.visibility != visibility:
            access.can_change_visibility(claims, owner, name, **facts).enforce()
            record(
                session,
                actor=claims.sub,
                jti=claims.jti,
                action="repo.visibility",
                target=f"{owner}/{name}",
                repo=f"{owner}/{name}",
                detail={"from": repo.visibility, "to": visibility},
            )
            repo.visibility = visibility
        return RepoInfo(repo.owner, repo.name, repo.visibility, repo.created_by, repo.created_at, created)


def yank_decision(session: Session, claims: Claims, owner: str, name: str) -> access.Decision:
    """Whether ``claims`` may yank a record of ``owner/name`` (a store admin; the root gate on reserved owners)."""
    platform_principal = _facts(session, claims, owner)["platform_principal"]
    return access.can_yank(claims, owner, name, platform_principal=platform_principal)


def _facts(session: Session, claims: Claims, owner: str) -> dict:
    """The facts access decisions need, looked up live (a demotion or a claim counts at once).

    The platform registration matters for a reserved owner, and for a ``plt``
    token anywhere (a visibility change); nobody else's is looked up.
    """
    reserved = is_reserved_owner(owner)
    return {
        "platform_principal": (reserved or claims.plt) and is_platform_principal(session, claims.sub),
        "holder": None if reserved else holder(session, owner),
    }


def _find_or_create(session: Session, claims: Claims, owner: str, name: str, visibility: str) -> tuple[Repo, bool]:
    repo = find_repo(session, owner, name)
    if repo is not None:
        return repo, False
    created = insert_ignoring_conflicts(
        session, Repo, owner=owner, name=name, visibility=visibility, created_by=claims.sub, created_at=utcnow()
    )
    if created:
        record(
            session,
            actor=claims.sub,
            jti=claims.jti,
            action="repo.create",
            target=f"{owner}/{name}",
            repo=f"{owner}/{name}",
            detail={"visibility": visibility},
        )
    return find_repo(session, owner, name), created
