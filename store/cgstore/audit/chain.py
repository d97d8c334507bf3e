"""Tamper evidence for the audit log: a hash chain over its entries, and signed checkpoints of its head.

The table is append-only through triggers, but whoever can disable a trigger
could rewrite history unseen. So every entry carries ``digest`` = blake3 over
its canonical content (every column but ``id``) and ``prev``, the digest of
the entry before it; the first chained entry's ``prev`` is ``GENESIS``.
Editing an entry breaks its own digest; deleting or moving one breaks the
link of the entry after it; recomputing the digests from there on is caught
by the signed checkpoints and by ``audit_head``.

Appends (``append``) first bump the one ``audit_head`` row: on PostgreSQL the
UPDATE holds its row lock until the transaction ends, so concurrent appenders,
in every process and replica, queue there (on SQLite the UPDATE takes the
database's write lock, which serializes writers anyway). Under that lock the
entry takes id ``last_id + 1`` and chains to the head's digest: id order is
chain order, with no gaps. The lock is held until the recording transaction
commits, which is why callers record last.

Entries written before the chain existed keep ``digest`` NULL (migration
0011): the chain starts at the first entry written after it, and ``verify``
counts the older ones as unchained.

Checkpoints (``checkpoint``): a periodic task (``CGSTORE_AUDIT_CHECKPOINT_INTERVAL_S``,
under a lease) signs the head, ``(audit_id, digest, iat)``, as a compact JWS
with the key ring that signs tokens and receipts (a ``typ`` no token check
accepts), so ``GET /v1/keys`` verifies it. Nothing after the last checkpoint is
signed: an attacker who deletes the tail and fixes ``audit_head`` goes unseen.
``verify`` trusts the ring's table by default; given a JWKS kept outside the
database (``jwks_public_keys``) it trusts only that, so a key planted in the
table signs nothing.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import blake3
import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from cgstore.audit.models import AuditCheckpoint, AuditEvent, AuditHead
from cgstore.core.db import insert_ignoring_conflicts, utcnow

if TYPE_CHECKING:
    from cgstore.tokens.ring import KeyRing

GENESIS = "0" * 64
HEAD_ID = 1
CHECKPOINT_TYP = "cgstore-audit-checkpoint+jwt"
CHECKPOINT_AUDIENCE = "cgstore-audit"
CHECKPOINT_ALGORITHM = "EdDSA"
# Entries read per query by ``verify`` (bounded memory, whatever the table's size).
_VERIFY_BATCH = 1000


def canonical(event: AuditEvent) -> bytes:
    """The bytes an entry's digest covers: every column but ``id`` and ``digest``, as sorted ASCII JSON.

    ``at`` in UTC to the microsecond (what both databases keep); ``detail`` as
    parsed back from JSON, so the digest computed at insert is the one
    recomputed from the stored row.
    """
    content = {
        "at": event.at.astimezone(dt.UTC).isoformat(timespec="microseconds"),
        "actor": event.actor,
        "jti": event.jti,
        "action": event.action,
        "target": event.target,
        "repo": event.repo,
        "outcome": event.outcome,
        "source": event.source,
        "count": event.count,
        "detail": event.detail,
        "prev": event.prev,
    }
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def entry_digest(event: AuditEvent) -> str:
    return blake3.blake3(canonical(event)).hexdigest()


def append(session: Session, event: AuditEvent) -> None:
    """Add ``event`` to the caller's transaction as the chain's next entry (its id, prev and digest set here)."""
    bump = (
        update(AuditHead)
        .where(AuditHead.id == HEAD_ID)
        .values(last_id=AuditHead.last_id + 1)
        .returning(AuditHead.last_id, AuditHead.digest)
        .execution_options(synchronize_session=False)
    )
    event.id, event.prev = session.execute(bump).one()
    event.digest = entry_digest(event)
    session.add(event)
    session.execute(  # flushes the entry first (autoflush): entry and head commit together
        update(AuditHead).where(AuditHead.id == HEAD_ID).values(digest=event.digest)
        .execution_options(synchronize_session=False)
    )


# -- checkpoints ------------------------------------------------------------------------


def checkpoint(session: Session, keys: KeyRing, *, issuer: str) -> AuditCheckpoint | None:
    """Sign the chain head now; ``None`` when nothing is chained yet or the head is signed already."""
    head = session.get(AuditHead, HEAD_ID)
    if head is None or head.digest == GENESIS:
        return None
    kid, private_key = keys.signing_key(session)
    at = utcnow()
    claims = {"iss": issuer, "aud": CHECKPOINT_AUDIENCE, "iat": int(at.timestamp()),
              "audit_id": head.last_id, "digest": head.digest}
    statement = jwt.encode(claims, private_key, algorithm=CHECKPOINT_ALGORITHM,
                           headers={"kid": kid, "typ": CHECKPOINT_TYP})
    row = {"audit_id": head.last_id, "digest": head.digest, "at": at, "kid": kid, "statement": statement}
    if not insert_ignoring_conflicts(session, AuditCheckpoint, **row):
        return None
    return AuditCheckpoint(**row)


def ring_public_keys(session: Session) -> dict[str, Ed25519PublicKey]:
    """Every key of the ring, retired ones included (a checkpoint stays evidence after its key retires).

    A row whose key does not hash to its kid is left out: its checkpoints fail.
    """
    from cgstore.tokens.ring import key_id
    from cgstore.tokens.models import SigningKey

    found = {}
    for kid, pem in session.execute(select(SigningKey.kid, SigningKey.public_key)):
        key = serialization.load_pem_public_key(pem.encode("ascii"))
        if isinstance(key, Ed25519PublicKey) and key_id(key) == kid:
            found[kid] = key
    return found


def jwks_public_keys(jwks: Mapping) -> Callable[[Session], dict[str, Ed25519PublicKey]]:
    """Trust exactly the keys of ``jwks`` (as ``GET /v1/keys`` answers), not the ``signing_keys`` table.

    Whoever can write the database can add a key of their own to the ring and
    sign forged checkpoints with it; a JWKS kept elsewhere cannot be edited so.
    A JWK whose key does not hash to its kid is left out.
    """
    from cgstore.tokens.ring import key_id

    found = {}
    for entry in jwks.get("keys", []):
        key = jwt.PyJWK(entry, algorithm=CHECKPOINT_ALGORITHM).key
        if isinstance(key, Ed25519PublicKey) and key_id(key) == entry.get("kid"):
            found[entry["kid"]] = key
    return lambda _session: found


def _checkpoint_fault(row: AuditCheckpoint, keys: Mapping[str, Ed25519PublicKey]) -> str | None:
    """Why ``row`` does not stand as a checkpoint, or ``None`` when its signature and claims hold."""
    try:
        header = jwt.get_unverified_header(row.statement)
        key = keys.get(header.get("kid"))
        if key is None or header.get("typ") != CHECKPOINT_TYP:
            return "checkpoint signature bad (unknown key or not a checkpoint)"
        claims = jwt.decode(row.statement, key, algorithms=[CHECKPOINT_ALGORITHM], audience=CHECKPOINT_AUDIENCE)
    except jwt.PyJWTError as err:
        return f"checkpoint signature bad ({err})"
    if claims.get("audit_id") != row.audit_id or claims.get("digest") != row.digest:
        return "checkpoint signature bad (its signed claims are not its columns)"
    return None


# -- verification -----------------------------------------------------------------------


@dataclass(frozen=True)
class Break:
    """The first entry at which the log is not what was chained, and why."""

    id: int
    reason: str


@dataclass
class Report:
    entries: int = 0
    unchained: int = 0
    first_id: int | None = None
    last_id: int | None = None
    checkpoints: int = 0
    broken: Break | None = None

    def summary(self) -> str:
        if self.broken is not None:
            return f"audit log broken at entry {self.broken.id}: {self.broken.reason}"
        span = f" (ids {self.first_id}..{self.last_id})" if self.entries else ""
        return (
            f"audit log intact: {self.entries} chained entries{span}, {self.checkpoints} signed checkpoints "
            f"verified, {self.unchained} entries from before the chain"
        )


def verify(
    session: Session, *, since: int | None = None, public_keys: Callable[[Session], Mapping[str, Ed25519PublicKey]]
    = ring_public_keys,
) -> Report:
    """Recompute the chain from entry ``since`` (default: the first) and check every checkpoint from there."""
    since = since or 0
    report = Report()
    keys = public_keys(session)
    checkpoints = {
        row.audit_id: row
        for row in session.scalars(select(AuditCheckpoint).where(AuditCheckpoint.audit_id >= since))
    }
    faults = [Break(row.audit_id, fault) for row in checkpoints.values() if (fault := _checkpoint_fault(row, keys))]
    before = session.scalars(
        select(AuditEvent).where(AuditEvent.id < since).order_by(AuditEvent.id.desc()).limit(1)
    ).first()
    walk = _Walk(session, report, checkpoints, before)
    chain_break = walk.run(since)
    if chain_break is None:
        chain_break = _head_fault(session, walk.last)
    faults += [chain_break] if chain_break else []
    # A checkpointed entry the walk never reached (and no earlier break explains) is missing.
    reached = walk.last.id if walk.last is not None else -1
    faults += [Break(i, "entry missing (a signed checkpoint names it)") for i in checkpoints if i > reached]
    report.checkpoints = len(checkpoints)
    report.broken = min(faults, key=lambda b: b.id) if faults else None
    return report


class _Walk:
    """The chain recomputed entry by entry, in id order; stops at the first break."""

    def __init__(self, session: Session, report: Report, checkpoints, before: AuditEvent | None) -> None:
        self.session, self.report, self.checkpoints = session, report, checkpoints
        self.last = before  # the entry the next one must chain to (None: none before)

    def run(self, since: int) -> Break | None:
        after = since - 1
        while True:
            rows = self.session.scalars(
                select(AuditEvent).where(AuditEvent.id > after).order_by(AuditEvent.id).limit(_VERIFY_BATCH)
            ).all()
            for row in rows:
                fault = self._check(row)
                if fault is not None:
                    return fault
                self.last = row
            if len(rows) < _VERIFY_BATCH:
                return None
            after = rows[-1].id

    def _check(self, row: AuditEvent) -> Break | None:
        chained_before = self.last is not None and self.last.digest is not None
        if row.digest is None:
            if chained_before:
                return Break(row.id, "content edited (its digest was removed)")
            self.report.unchained += 1
            return None
        if entry_digest(row) != row.digest:
            return Break(row.id, "content edited (its digest does not match its content)")
        expected = self.last.digest if chained_before else GENESIS
        if row.prev != expected:
            return self._link_fault(row)
        signed = self.checkpoints.get(row.id)
        if signed is not None and signed.digest != row.digest:
            return Break(row.id, "content edited (its digest differs from the signed checkpoint's)")
        self.report.entries += 1
        self.report.first_id = self.report.first_id or row.id
        self.report.last_id = row.id
        return None

    def _link_fault(self, row: AuditEvent) -> Break:
        """``row`` does not chain to the entry before it: moved, a predecessor gone, or one rewritten."""
        moved_from = self.session.scalar(select(AuditEvent.id).where(AuditEvent.digest == row.prev))
        if moved_from is not None:
            return Break(row.id, f"order changed (it chains to entry {moved_from}, not to the entry before it)")
        previous_id = self.last.id if self.last is not None else None
        # Chained ids have no gaps (audit_head hands them out): a gap is a deleted entry.
        if row.prev != GENESIS and (previous_id is None or previous_id < row.id - 1):
            return Break(row.id - 1, f"entry missing (entry {row.id} chains to an entry no longer there)")
        return Break(previous_id or row.id, f"content edited (entry {row.id} no longer chains to it)")


def _head_fault(session: Session, last: AuditEvent | None) -> Break | None:
    """The head names the last entry appended: entries after the walk's last are missing."""
    head = session.get(AuditHead, HEAD_ID)
    if head is None or head.digest == GENESIS:
        return None
    if last is None or head.last_id > last.id:
        return Break((last.id if last else 0) + 1, f"entry missing (the head names entry {head.last_id} as the last)")
    if head.last_id == last.id and head.digest != last.digest:
        return Break(last.id, "content edited (its digest differs from the head's)")
    return None
