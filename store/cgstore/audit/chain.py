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
0011): the chain starts at the first entry written after it,
``audit_head.start_id`` (migration 0016). ``verify`` counts entries before the
start as unchained; from the start on, an entry without a digest is a break,
never "older than the chain".

Checkpoints (``checkpoint``): a periodic task (``CGSTORE_AUDIT_CHECKPOINT_INTERVAL_S``,
under a lease) signs the head and the chain's start, ``(audit_id, digest,
start, iat)``, as a compact JWS with the key ring that signs tokens and
receipts (a ``typ`` no token check accepts), so ``GET /v1/keys`` verifies it.
Every checkpoint's entry must still hold the signed digest (an entry that lost
its digest is a break, not history), and every checkpoint must sign the start
the oldest one signed. ``verify`` trusts the ring's table by default; given a
JWKS kept outside the database (``jwks_public_keys``) it trusts only that, so a
key planted in the table signs nothing.

Nothing in the database vouches for the tail after the last checkpoint it
still holds: an attacker who deletes the tail (and the checkpoints naming it)
and fixes ``audit_head`` leaves a valid chain. So a verifier keeps checkpoints
elsewhere (``saved_document``: the JWS and its key's JWK, verifiable offline)
and later checks that the log extends one (``verify(saved=...)``: its entry
still there with its digest, the head not behind it), as a transparency log's
client checks consistency with the tree head it saw last.
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
from sqlalchemy import func, select, update
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
        update(AuditHead)
        .where(AuditHead.id == HEAD_ID)
        .values(digest=event.digest)
        .execution_options(synchronize_session=False)
    )


# -- checkpoints ------------------------------------------------------------------------


def checkpoint(session: Session, keys: KeyRing, *, issuer: str) -> AuditCheckpoint | None:
    """Sign the chain head (and where the chain starts) now; ``None`` when nothing is chained or it is signed already."""
    head = session.get(AuditHead, HEAD_ID)
    if head is None or head.digest == GENESIS:
        return None
    kid, private_key = keys.signing_key(session)
    at = utcnow()
    claims = {
        "iss": issuer,
        "aud": CHECKPOINT_AUDIENCE,
        "iat": int(at.timestamp()),
        "audit_id": head.last_id,
        "digest": head.digest,
        "start": head.start_id,
    }
    statement = jwt.encode(
        claims, private_key, algorithm=CHECKPOINT_ALGORITHM, headers={"kid": kid, "typ": CHECKPOINT_TYP}
    )
    row = {
        "audit_id": head.last_id,
        "digest": head.digest,
        "at": at,
        "kid": kid,
        "statement": statement,
        "start_id": head.start_id,
    }
    if not insert_ignoring_conflicts(session, AuditCheckpoint, **row):
        return None
    return AuditCheckpoint(**row)


def ring_public_keys(session: Session) -> dict[str, Ed25519PublicKey]:
    """Every key of the ring, retired ones included (a checkpoint stays evidence after its key retires).

    A row whose key does not hash to its kid is left out: its checkpoints fail.
    """
    from cgstore.tokens.models import SigningKey
    from cgstore.tokens.ring import key_id

    found = {}
    for kid, pem in session.execute(select(SigningKey.kid, SigningKey.public_key)):
        key = serialization.load_pem_public_key(pem.encode("ascii"))
        if isinstance(key, Ed25519PublicKey) and key_id(key) == kid:
            found[kid] = key
    return found


def jwks_keys(jwks: Mapping) -> dict[str, Ed25519PublicKey]:
    """The Ed25519 keys of ``jwks`` by kid; a JWK whose key does not hash to its kid is left out."""
    from cgstore.tokens.ring import key_id

    found = {}
    for entry in jwks.get("keys", []):
        key = jwt.PyJWK(entry, algorithm=CHECKPOINT_ALGORITHM).key
        if isinstance(key, Ed25519PublicKey) and key_id(key) == entry.get("kid"):
            found[entry["kid"]] = key
    return found


def jwks_public_keys(jwks: Mapping) -> Callable[[Session], dict[str, Ed25519PublicKey]]:
    """Trust exactly the keys of ``jwks`` (as ``GET /v1/keys`` answers), not the ``signing_keys`` table.

    Whoever can write the database can add a key of their own to the ring and
    sign forged checkpoints with it; a JWKS kept elsewhere cannot be edited so.
    """
    found = jwks_keys(jwks)
    return lambda _session: found


def _signed_claims(statement: str, keys: Mapping[str, Ed25519PublicKey]) -> tuple[dict | None, str | None]:
    """The claims of a checkpoint's JWS when its signature holds, else ``None`` and why not."""
    try:
        header = jwt.get_unverified_header(statement)
        key = keys.get(header.get("kid"))
        if key is None or header.get("typ") != CHECKPOINT_TYP:
            return None, "unknown key or not a checkpoint"
        claims = jwt.decode(statement, key, algorithms=[CHECKPOINT_ALGORITHM], audience=CHECKPOINT_AUDIENCE)
    except jwt.PyJWTError as err:
        return None, str(err)
    if not isinstance(claims.get("audit_id"), int) or not isinstance(claims.get("digest"), str):
        return None, "its claims name no entry"
    return claims, None


def _checkpoint_fault(row: AuditCheckpoint, keys: Mapping[str, Ed25519PublicKey]) -> str | None:
    """Why ``row`` does not stand as a checkpoint, or ``None`` when its signature and claims hold."""
    claims, why = _signed_claims(row.statement, keys)
    if claims is None:
        return f"checkpoint signature bad ({why})"
    if (claims["audit_id"], claims["digest"], claims.get("start")) != (row.audit_id, row.digest, row.start_id):
        return "checkpoint signature bad (its signed claims are not its columns)"
    return None


# -- a checkpoint saved outside the database --------------------------------------------


class SavedCheckpointError(ValueError):
    """A file that is not a saved checkpoint (``cgstore audit checkpoint --save`` writes them)."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint a verifier kept (``checkpoint --save``): what today's log must extend.

    ``fault`` says why its signature does not hold (``None`` when it does); the
    other fields are then read unverified, only to name the entry.
    """

    audit_id: int
    digest: str
    start_id: int | None
    fault: str | None = None


def saved_document(
    session: Session, public_keys: Callable[[Session], Mapping[str, Ed25519PublicKey]] = ring_public_keys
) -> dict | None:
    """The newest checkpoint as a self-contained JSON document (its JWS and its key's JWK); ``None``: none yet.

    The checkpoint must verify against ``public_keys`` first: a forged row is
    never saved as evidence. The JWK lets anyone verify the file offline.
    """
    from cgstore.tokens.ring import jwk

    row = session.scalars(select(AuditCheckpoint).order_by(AuditCheckpoint.audit_id.desc()).limit(1)).first()
    if row is None:
        return None
    keys = public_keys(session)
    fault = _checkpoint_fault(row, keys)
    if fault is not None:
        raise SavedCheckpointError(f"the newest checkpoint (entry {row.audit_id}) does not verify: {fault}")
    return {
        "audit_id": row.audit_id,
        "digest": row.digest,
        "start_id": row.start_id,
        "statement": row.statement,
        "jwk": jwk(row.kid, keys[row.kid]),
    }


def load_saved(document: object, trusted: Mapping[str, Ed25519PublicKey] | None = None) -> SavedCheckpoint:
    """The checkpoint a saved document holds, its signature checked against ``trusted`` (default: its own JWK).

    Only the signed claims count; the document's plain ``audit_id``/``digest`` are for people.
    """
    if not isinstance(document, dict) or not isinstance(document.get("statement"), str):
        raise SavedCheckpointError('not a saved checkpoint (an object with a "statement")')
    if trusted is None:
        try:
            trusted = jwks_keys({"keys": [document.get("jwk")]})
        except (jwt.PyJWTError, TypeError, AttributeError) as err:
            raise SavedCheckpointError(f"its jwk is not an Ed25519 JWK ({err})") from None
    claims, why = _signed_claims(document["statement"], trusted)
    if claims is not None:
        return SavedCheckpoint(claims["audit_id"], claims["digest"], claims.get("start"))
    try:  # unverified, only to name the entry in the report
        unverified = jwt.decode(document["statement"], options={"verify_signature": False})
    except jwt.PyJWTError as err:
        raise SavedCheckpointError(f"its statement is not a JWS ({err})") from None
    audit_id = unverified.get("audit_id")
    if not isinstance(audit_id, int):
        raise SavedCheckpointError("its statement names no entry")
    return SavedCheckpoint(audit_id, str(unverified.get("digest")), None, fault=why)


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
    start_id: int | None = None
    extends: int | None = None  # the saved checkpoint's entry, when the log was checked against one
    broken: Break | None = None

    def summary(self) -> str:
        if self.broken is not None:
            return f"audit log broken at entry {self.broken.id}: {self.broken.reason}"
        span = f" (ids {self.first_id}..{self.last_id})" if self.entries else ""
        extends = f"; it extends the saved checkpoint of entry {self.extends}" if self.extends is not None else ""
        return (
            f"audit log intact: {self.entries} chained entries{span}, {self.checkpoints} signed checkpoints "
            f"verified, {self.unchained} entries from before the chain{extends}"
        )


def verify(
    session: Session,
    *,
    since: int | None = None,
    public_keys: Callable[[Session], Mapping[str, Ed25519PublicKey]] = ring_public_keys,
    saved: SavedCheckpoint | None = None,
) -> Report:
    """Recompute the chain from entry ``since`` (default: the first) and check every checkpoint from there.

    ``saved``: a checkpoint kept outside the database; the log must extend it
    (its entry present with its digest, the head not behind it).
    """
    since = since or 0
    report = Report()
    keys = public_keys(session)
    checkpoints = {
        row.audit_id: row for row in session.scalars(select(AuditCheckpoint).where(AuditCheckpoint.audit_id >= since))
    }
    # The head before the walk: entries appended meanwhile are then past it, never "missing" before it.
    head = session.get(AuditHead, HEAD_ID)
    faults = [] if saved is None else _saved_faults(session, saved, head)  # first: it names the same entry best
    bad = {row.audit_id: fault for row in checkpoints.values() if (fault := _checkpoint_fault(row, keys))}
    faults += [Break(i, fault) for i, fault in bad.items()]
    valid = {i: row for i, row in checkpoints.items() if i not in bad}
    start, start_faults = _chain_start(session, keys, valid, saved, head)
    faults += start_faults
    expected = {i: [(row.digest, "the signed checkpoint")] for i, row in checkpoints.items()}
    if saved is not None and saved.fault is None and saved.audit_id >= since:
        expected.setdefault(saved.audit_id, []).append((saved.digest, "the saved checkpoint"))
    before = session.scalars(
        select(AuditEvent).where(AuditEvent.id < since).order_by(AuditEvent.id.desc()).limit(1)
    ).first()
    walk = _Walk(session, report, expected, before, start)
    chain_break = walk.run(since)
    # A checkpointed entry the walk did not come to is missing: before its break, or past the chain's end.
    uncompared = sorted(expected.keys() - walk.compared)
    if chain_break is not None:
        faults += [chain_break] + [
            Break(i, f"entry missing ({expected[i][0][1]} names it)") for i in uncompared if i < chain_break.id
        ]
    else:
        faults += [fault] if (fault := _head_fault(head, walk.chained, start)) else []
        ends = walk.chained.id if walk.chained is not None else None
        faults += [_missing(i, ends, start, expected[i][0][1]) for i in uncompared]
    report.checkpoints = len(checkpoints)
    report.start_id = start
    report.extends = saved.audit_id if saved is not None else None
    report.broken = min(faults, key=lambda b: b.id) if faults else None
    return report


def _chain_start(
    session: Session,
    keys: Mapping[str, Ed25519PublicKey],
    valid: Mapping[int, AuditCheckpoint],
    saved: SavedCheckpoint | None,
    head: AuditHead | None,
) -> tuple[int | None, list[Break]]:
    """Where the chain starts, as signed, and every checkpoint that says otherwise.

    The saved checkpoint's word first (kept outside the database), then the
    oldest verified checkpoint that signs a start; the head's unsigned
    ``start_id`` only for a log no checkpoint signed a start of yet.
    """
    start = saved.start_id if saved is not None and saved.fault is None else None
    if start is None:
        signing = (
            select(AuditCheckpoint).where(AuditCheckpoint.start_id.is_not(None)).order_by(AuditCheckpoint.audit_id)
        )
        for row in session.scalars(signing):
            if _checkpoint_fault(row, keys) is None:
                start = row.start_id
                break
    if start is None:
        return (head.start_id if head is not None else None), []
    # The head's own start_id is not compared: unsigned, it matters only once a checkpoint signs it.
    return start, [
        Break(i, f"checkpoint signs another chain start (entry {row.start_id}, not entry {start})")
        for i, row in valid.items()
        if row.start_id is not None and row.start_id != start
    ]


def _saved_faults(session: Session, saved: SavedCheckpoint, head: AuditHead | None) -> list[Break]:
    """How today's log fails to extend ``saved``: its signature, its entry, or a head behind it."""
    if saved.fault is not None:
        return [Break(saved.audit_id, f"saved checkpoint signature bad ({saved.fault})")]
    entry = session.get(AuditEvent, saved.audit_id)
    faults = []
    if entry is None:
        last = session.scalar(select(func.max(AuditEvent.id)).where(AuditEvent.id < saved.audit_id)) or 0
        faults.append(_missing(saved.audit_id, last, None, "the saved checkpoint"))
    elif entry.digest is None:
        faults.append(Break(entry.id, "unchained (its digest was removed; the saved checkpoint names it)"))
    elif entry.digest != saved.digest:
        faults.append(Break(entry.id, "content edited (its digest differs from the saved checkpoint's)"))
    if head is None or head.last_id < saved.audit_id:
        last = head.last_id if head is not None else 0
        faults.append(
            Break(
                last + 1,
                f"log truncated (the head names entry {last}, behind the saved checkpoint of entry {saved.audit_id})",
            )
        )
    return faults


def _missing(audit_id: int, ends: int | None, start: int | None, who: str) -> Break:
    """Entry ``audit_id`` (named by ``who``) is not in the log, which ends at ``ends``: name the first one gone."""
    if ends is not None and ends < audit_id:
        first = max(ends + 1, start or 0)
        return Break(first, f"entry missing ({who} names entry {audit_id}; the chain ends at entry {ends})")
    return Break(audit_id, f"entry missing ({who} names it)")


class _Walk:
    """The chain recomputed entry by entry, in id order; stops at the first break.

    From ``start`` on every entry must be chained: an entry without a digest
    there is a break, never "from before the chain". ``compared`` holds the
    ids whose checkpoints were compared; ``chained`` is the last chained entry
    verified (an unchained one never counts as reached).
    """

    def __init__(
        self, session: Session, report: Report, expected, before: AuditEvent | None, start: int | None
    ) -> None:
        self.session, self.report, self.expected, self.start = session, report, expected, start
        self.last = before  # the entry the next one must chain to (None: none before)
        self.chained = before if before is not None and before.digest is not None else None
        self.compared: set[int] = set()

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
        signed = self.expected.get(row.id, [])
        if signed:  # only checkpointed ids: memory stays bounded however long the log
            self.compared.add(row.id)
        if row.digest is None:
            return self._unchained(row, signed)
        if self.start is not None and row.id < self.start:
            return Break(row.id, f"chained before the chain's start (entry {self.start})")
        if entry_digest(row) != row.digest:
            return Break(row.id, "content edited (its digest does not match its content)")
        if row.prev != self._expected_prev(row):
            return self._link_fault(row)
        for digest, who in signed:
            if digest != row.digest:
                return Break(row.id, f"content edited (its digest differs from {who}'s)")
        self.chained = row
        self.report.entries += 1
        self.report.first_id = self.report.first_id or row.id
        self.report.last_id = row.id
        return None

    def _unchained(self, row: AuditEvent, signed) -> Break | None:
        """An entry without a digest: history from before the chain only before its (signed) start."""
        if signed:
            return Break(row.id, f"unchained (its digest was removed; {signed[0][1]} names it)")
        if self.start is not None and row.id >= self.start:
            return Break(row.id, f"unchained (its digest was removed; the chain starts at entry {self.start})")
        if self.start is None and self.chained is not None:
            return Break(row.id, "unchained (its digest was removed)")
        self.report.unchained += 1
        return None

    def _expected_prev(self, row: AuditEvent) -> str | None:
        """What ``row.prev`` must be: the genesis at the start, else the digest of the chained entry just before."""
        if row.id == self.start or (self.start is None and self.chained is None):
            return GENESIS
        if self.last is not None and self.last.digest is not None:
            return self.last.digest
        return None  # nothing chained before it: it cannot chain to anything

    def _link_fault(self, row: AuditEvent) -> Break:
        """``row`` does not chain to the entry before it: moved, a predecessor gone, or one rewritten."""
        moved_from = self.session.scalar(select(AuditEvent.id).where(AuditEvent.digest == row.prev))
        if moved_from is not None:
            return Break(row.id, f"order changed (it chains to entry {moved_from}, not to the entry before it)")
        if row.id == self.start:
            return Break(row.id, "content edited (the chain's first entry does not chain to the genesis)")
        previous_id = self.last.id if self.last is not None else None
        # Chained ids have no gaps from the start on (audit_head hands them out): a gap is a deleted entry.
        first_gone = max(previous_id + 1 if previous_id is not None else 0, self.start or 0)
        if first_gone and first_gone < row.id:
            return Break(first_gone, f"entry missing (entry {row.id} chains to an entry no longer there)")
        if previous_id is None:
            return Break(row.id, "content edited (it chains to no entry before it)")
        return Break(previous_id, f"content edited (entry {row.id} no longer chains to it)")


def _head_fault(head: AuditHead | None, last: AuditEvent | None, start: int | None) -> Break | None:
    """The head names the last entry appended: chained entries after the walk's last are missing."""
    if head is None:
        return None
    if last is None and head.digest == GENESIS and (start is None or head.last_id < start):
        return None  # nothing chained yet
    if last is None or head.last_id > last.id:
        first = max((last.id if last else 0) + 1, start or 0)
        return Break(first, f"entry missing (the head names entry {head.last_id} as the last)")
    if head.last_id == last.id and head.digest != last.digest:
        return Break(last.id, "content edited (its digest differs from the head's)")
    return None
