"""Finding repos for reading and writing, with the access rules applied.

Reads of a repo the caller may not read look exactly like reads of a repo that
does not exist (the caller gets None, and raises the same miss either way).
Writes check the token's grant and the root gate. Checking never creates
anything: a repo comes into being only with a successful write
(``ensure_repo``, called in the transaction that records that write), so a
refused or failed call leaves no repo behind.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from cgstore.core.db import insert_ignoring_conflicts, utcnow
from cgstore.core.errors import StoreError, hidden_miss
from cgstore.core.names import validate_owner, validate_repo
from cgstore.repos.models import Repo
from cgstore.tokens.service import Claims, TokenService


def find_repo(session: Session, owner: str, name: str) -> Repo | None:
    return session.scalar(select(Repo).where(Repo.owner == owner, Repo.name == name))


def readable_repo(
    session: Session,
    tokens: TokenService,
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
    if not tokens.can_read(claims, owner, name):
        raise hidden_miss(miss, message, **detail)
    repo = find_repo(session, owner, name)
    if repo is None:
        raise miss(message, **detail)
    return repo


def writable_repo(session: Session, tokens: TokenService, claims: Claims, owner: str, name: str) -> Repo | None:
    """The repo ``claims`` may write, or None while it does not exist yet (nothing is created)."""
    tokens.can_write(claims, owner, name)  # validates both names first
    return find_repo(session, owner, name)


def ensure_repo(session: Session, claims: Claims, owner: str, name: str) -> Repo:
    """The repo, created (visibility ``owner``) if absent: only for a write that succeeded.

    The caller has already passed ``writable_repo``; it calls this in the same
    transaction that records the write, so the repo and the write land together.
    """
    repo = find_repo(session, owner, name)
    if repo is None:
        insert_ignoring_conflicts(
            session, Repo, owner=owner, name=name, visibility="owner", created_by=claims.sub, created_at=utcnow()
        )
        repo = find_repo(session, owner, name)
    return repo
