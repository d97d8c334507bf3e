"""Tamper evidence (issue 15 §5): the audit log is a digest chain with signed checkpoints; ``cgstore audit verify``.

Tampering needs the append-only triggers out of the way, so those tests run on
a database of their own (SQLite file, or a fresh PostgreSQL database): on
PostgreSQL ``session_replication_role = replica`` skips the triggers for one
transaction, on SQLite the triggers are dropped. The concurrency test runs on
the shared stores (and, in production, on a second store on the same database).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import blake3
import jwt
import pytest
import sqlalchemy.exc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import delete, select, text, update
from typer.testing import CliRunner

from cgstore.audit import chain
from cgstore.audit.models import AuditCheckpoint, AuditEvent
from cgstore.audit.service import record
from cgstore.cli import app
from cgstore.core import migrate
from cgstore.core.db import Database, utcnow
from cgstore.settings import Settings
from cgstore.tokens.models import SigningKey
from cgstore.tokens.ring import KeyRing, jwk, key_id, public_pem
from tests.audit.conftest import last_id
from tests.support import services
from tests.support.live_store import CONFIGURATIONS, unique_repo

DATA = b"audited bytes"
DIGEST = "blake3:" + blake3.blake3(DATA).hexdigest()
CHAIN_COLUMNS = (
    "at",
    "actor",
    "jti",
    "action",
    "target",
    "repo",
    "outcome",
    "source",
    "count",
    "detail",
    "prev",
    "digest",
)


@dataclass
class Log:
    """An audit log in a database of its own, with the CLI's environment to verify it."""

    db: Database
    settings: Settings

    def write(self, n: int) -> list[int]:
        for i in range(n):
            with self.db.session() as session:
                record(
                    session,
                    actor="writer",
                    jti=None,
                    action=f"test.entry{i}",
                    target=f"t{i}",
                    detail={"i": i, "float": 0.1, "list": ["a", None]},
                )
        with self.db.session() as session:
            return list(session.scalars(select(AuditEvent.id).order_by(AuditEvent.id)))

    def cli(self, *args: str):
        env = {
            "CGSTORE_HOME": str(self.settings.home),
            "CGSTORE_DATABASE_URL": self.settings.resolved_database_url,
            "COLUMNS": "400",  # rich would fold an error message to the terminal width
        }
        return CliRunner().invoke(app, ["audit", *args], env=env)

    @contextlib.contextmanager
    def untriggered(self) -> Iterator:
        """A transaction the append-only triggers do not see (what an attacker with the database's keys gets)."""
        with self.db.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SET LOCAL session_replication_role = replica"))
            else:
                for trigger in (
                    "audit_events_no_update",
                    "audit_events_no_delete",
                    "audit_checkpoints_no_update",
                    "audit_checkpoints_no_delete",
                    "audit_head_no_delete",
                ):
                    conn.execute(text(f"DROP TRIGGER IF EXISTS {trigger}"))
            yield conn


@pytest.fixture(params=CONFIGURATIONS)
def empty_url(request, tmp_path: Path) -> Iterator[str]:
    """A database of the test's own, not migrated yet."""
    if request.param == "production":
        with services.postgres_database("cgstore_chain") as url:
            yield url
    else:
        yield f"sqlite:///{tmp_path / 'chain.db'}"


@pytest.fixture
def log(empty_url, tmp_path: Path) -> Iterator[Log]:
    migrate.upgrade(empty_url)
    db = Database(empty_url)
    try:
        yield Log(db, Settings(home=tmp_path / "home", database_url=empty_url))
    finally:
        db.dispose()


def _checkpoint(log: Log) -> None:
    result = log.cli("checkpoint")
    assert result.exit_code == 0 and "signed entry" in result.output, result.output


def _verify_fails(log: Log, entry: int, reason: str) -> None:
    result = log.cli("verify")
    assert result.exit_code == 1, result.output
    assert f"broken at entry {entry}: {reason}" in result.output


def test_an_untouched_log_verifies(log):
    ids = log.write(5)
    _checkpoint(log)
    assert log.cli("checkpoint").output.strip() == "nothing new to sign"  # the head is signed already
    ids += log.write(3)[5:]
    result = log.cli("verify")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == (
        f"audit log intact: 8 chained entries (ids {ids[0]}..{ids[-1]}), 1 signed checkpoints verified, "
        "0 entries from before the chain"
    )
    assert ids == list(range(ids[0], ids[0] + 8))  # the head hands out ids without gaps


def test_an_edited_entry_is_named(log):
    ids = log.write(6)
    with log.untriggered() as conn:
        conn.execute(update(AuditEvent).where(AuditEvent.id == ids[2]).values(outcome="ok-rewritten"))
    _verify_fails(log, ids[2], "content edited (its digest does not match its content)")


def test_a_deleted_entry_is_named(log):
    ids = log.write(6)
    with log.untriggered() as conn:
        conn.execute(delete(AuditEvent).where(AuditEvent.id == ids[2]))
    _verify_fails(log, ids[2], "entry missing")


def test_swapped_entries_are_named(log):
    """Both rows swapped whole (digests too): each is self-consistent, but the links are out of order."""
    ids = log.write(6)
    with log.db.session() as session:
        a, b = (session.get(AuditEvent, i) for i in ids[2:4])
        values_a, values_b = ({c: getattr(row, c) for c in CHAIN_COLUMNS} for row in (a, b))
    with log.untriggered() as conn:
        # Through a free digest first: the unique index refuses two rows with one digest, even for a moment.
        conn.execute(update(AuditEvent).where(AuditEvent.id == ids[2]).values(digest=None))
        conn.execute(update(AuditEvent).where(AuditEvent.id == ids[3]).values(**values_a))
        conn.execute(update(AuditEvent).where(AuditEvent.id == ids[2]).values(**values_b))
    _verify_fails(log, ids[2], f"order changed (it chains to entry {ids[3]}")


def test_a_deleted_tail_is_named_by_the_head(log):
    ids = log.write(4)
    with log.untriggered() as conn:
        conn.execute(delete(AuditEvent).where(AuditEvent.id == ids[-1]))
    _verify_fails(log, ids[-1], f"entry missing (the head names entry {ids[-1]} as the last)")


def test_a_rewritten_chain_is_caught_by_the_signed_checkpoint(log):
    """Edit an entry and recompute every digest after it (and the head's): only the signature tells."""
    ids = log.write(5)
    _checkpoint(log)
    with log.db.session() as session:
        stored = [session.get(AuditEvent, i) for i in ids[1:]]
    forged, prev = [], stored[0].digest
    for event in stored[1:]:
        copy = AuditEvent(**{column: getattr(event, column) for column in CHAIN_COLUMNS})
        copy.outcome = "ok-forged" if event.id == ids[2] else event.outcome
        copy.prev = prev
        prev = copy.digest = chain.entry_digest(copy)
        forged.append((event.id, copy))
    with log.untriggered() as conn:
        for event_id, copy in forged:
            conn.execute(
                update(AuditEvent)
                .where(AuditEvent.id == event_id)
                .values(outcome=copy.outcome, prev=copy.prev, digest=copy.digest)
            )
        conn.execute(text("UPDATE audit_head SET digest = :digest"), {"digest": prev})
    _verify_fails(log, ids[-1], "content edited (its digest differs from the signed checkpoint's)")


def test_a_forged_checkpoint_signature_is_named(log):
    ids = log.write(3)
    _checkpoint(log)
    with log.untriggered() as conn:
        where = AuditCheckpoint.audit_id == ids[-1]
        header, claims, signature = conn.scalar(select(AuditCheckpoint.statement).where(where)).split(".")
        conn.execute(update(AuditCheckpoint).where(where).values(statement=f"{header}.{claims}.{signature[:-4]}AAAA"))
    _verify_fails(log, ids[-1], "checkpoint signature bad")


def test_since_starts_the_walk_at_an_entry(log):
    ids = log.write(6)
    with log.untriggered() as conn:
        conn.execute(update(AuditEvent).where(AuditEvent.id == ids[1]).values(outcome="ok-rewritten"))
    assert log.cli("verify", "--since", str(ids[3])).exit_code == 0  # what came before is not looked at
    result = log.cli("verify", "--since", str(ids[1]))
    assert result.exit_code == 1 and f"broken at entry {ids[1]}" in result.output


def test_the_migration_starts_the_chain_after_the_existing_entries(empty_url, tmp_path):
    migrate.upgrade(empty_url, "0009_scrub")
    db = Database(empty_url)
    try:
        with db.engine.begin() as conn:  # two entries from before the chain (a gap between them, as sequences leave)
            for old_id in (7, 9):
                conn.execute(
                    text(
                        "INSERT INTO audit_events (id, at, actor, action, target, outcome, count, detail) "
                        "VALUES (:id, CURRENT_TIMESTAMP, 'old', 'test.old', 't', 'ok', 1, '{}')"
                    ),
                    {"id": old_id},
                )
        migrate.upgrade(empty_url)
        log = Log(db, Settings(home=tmp_path / "home", database_url=empty_url))
        assert log.write(2) == [7, 9, 10, 11]
        result = log.cli("verify")
    finally:
        db.dispose()
    assert result.exit_code == 0, result.output
    assert "2 chained entries (ids 10..11)" in result.output and "2 entries from before the chain" in result.output


def test_a_checkpoint_never_authenticates(store):
    with store.context.db.session() as session:
        record(session, actor="tester", jti=None, action="test.checkpoint", target=unique_repo("cp"))
    with store.context.db.session() as session:
        signed = chain.checkpoint(session, store.context.tokens.ring, issuer=store.settings.token_issuer)
    with store.client(signed.statement) as client:
        assert client.get("/v1/audit").status_code == 401


def test_the_server_signs_the_head_periodically(make_store, store):
    live = make_store(store.configuration, audit_checkpoint_interval_s=0.2)
    with live.context.db.session() as session:
        record(session, actor="tester", jti=None, action="test.periodic", target=unique_repo("periodic"))
    head = last_id(live)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with live.context.db.session() as session:
            if session.scalar(select(AuditCheckpoint.audit_id).where(AuditCheckpoint.audit_id >= head)):
                return
        time.sleep(0.1)
    pytest.fail("no checkpoint was signed")


def test_concurrent_appends_from_several_stores_still_verify(make_store, store):
    """8 threads x 20 audited requests (403s), spread over two stores on one database in production."""
    stores = [store, make_store("production")] if store.configuration == "production" else [store]
    first = last_id(store) + 1
    name = unique_repo("concurrent")
    token = store.mint("mallory", f"acme/{unique_repo()}:read,write")

    def deny(worker: int) -> None:
        with stores[worker % len(stores)].client(token) as client:
            for _ in range(20):
                assert client.put(f"/v1/repos/acme/{name}/blobs/{DIGEST}", content=DATA).status_code == 403

    threads = [threading.Thread(target=deny, args=(worker,)) for worker in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with store.context.db.session() as session:
        report = chain.verify(session, since=first)
        denied = session.scalars(select(AuditEvent.id).where(AuditEvent.id >= first, AuditEvent.repo == f"acme/{name}"))
        assert len(denied.all()) == 160
    assert report.broken is None, report.summary()
    assert report.entries >= 160


def test_a_key_planted_in_the_ring_signs_nothing_for_a_pinned_jwks(log, tmp_path):
    """Whoever writes the database can add a key to ``signing_keys``: only a JWKS kept elsewhere tells."""
    ids = log.write(3)
    _checkpoint(log)
    ring = KeyRing(log.db, log.settings)
    with log.db.session() as session:
        pinned = {"keys": ring.jwks(session)}
    (tmp_path / "jwks.json").write_text(json.dumps(pinned))
    planted = Ed25519PrivateKey.generate()
    with log.untriggered() as conn:
        conn.execute(update(AuditEvent).where(AuditEvent.id == ids[-1]).values(outcome="ok-forged"))
    with log.db.session() as session:  # rechain the edited entry, sign the new head with the planted key
        event = session.get(AuditEvent, ids[-1])
        forged = chain.entry_digest(event)
        session.add(
            SigningKey(
                kid=key_id(planted.public_key()), public_key=public_pem(planted.public_key()), created_at=utcnow()
            )
        )
        claims = {
            "iss": "cgstore",
            "aud": chain.CHECKPOINT_AUDIENCE,
            "iat": 0,
            "audit_id": ids[-1],
            "digest": forged,
            "start": ids[0],
        }
        statement = jwt.encode(
            claims,
            planted,
            algorithm="EdDSA",
            headers={"kid": key_id(planted.public_key()), "typ": chain.CHECKPOINT_TYP},
        )
        session.execute(text("UPDATE audit_head SET digest = :digest"), {"digest": forged})
    with log.untriggered() as conn:
        conn.execute(update(AuditEvent).where(AuditEvent.id == ids[-1]).values(digest=forged))
        conn.execute(
            update(AuditCheckpoint)
            .where(AuditCheckpoint.audit_id == ids[-1])
            .values(digest=forged, statement=statement, kid=key_id(planted.public_key()))
        )
    assert log.cli("verify").exit_code == 0  # the table vouches for the planted key (see docs/security.md)
    result = log.cli("verify", "--keys", str(tmp_path / "jwks.json"))
    assert result.exit_code == 1
    assert f"broken at entry {ids[-1]}: checkpoint signature bad (unknown key or not a checkpoint)" in result.output


def test_keys_must_be_a_jwks(log, tmp_path):
    (tmp_path / "not.json").write_text("[1, 2]")
    result = log.cli("verify", "--keys", str(tmp_path / "not.json"))
    assert result.exit_code == 2 and "not a JWKS" in result.output
    (tmp_path / "rsa.json").write_text(json.dumps({"keys": [{"kty": "RSA", "kid": "x"}]}))
    result = log.cli("verify", "--keys", str(tmp_path / "rsa.json"))
    assert result.exit_code == 2 and "not an Ed25519 JWK" in result.output, result.output


def test_the_database_refuses_to_change_a_checkpoint_or_delete_the_head(log):
    """Checkpoints are append-only and the head row stays (revision 0014): hiding an edit behind a removed
    checkpoint needs the triggers out of the way first, as editing an entry does."""
    log.write(3)
    _checkpoint(log)
    statements = [
        "UPDATE audit_checkpoints SET digest = 'x'",
        "DELETE FROM audit_checkpoints",
        "DELETE FROM audit_head",
    ]
    if log.db.engine.dialect.name == "postgresql":
        statements += ["TRUNCATE audit_checkpoints", "TRUNCATE audit_head"]
    for statement in statements:
        with pytest.raises(sqlalchemy.exc.DBAPIError, match="append-only"):
            with log.db.engine.begin() as conn:
                conn.execute(text(statement))
    assert log.cli("verify").exit_code == 0
    log.write(1)  # the head still moves: appends update it
    _checkpoint(log)
    assert log.cli("verify").exit_code == 0


# -- issue 30 §1: rewrites that cleared digests, and a tail cut behind a saved checkpoint ------------------------


def _rechain(log: Log, event_ids: list[int], prev: str) -> str:
    """Recompute ``prev`` and ``digest`` of ``event_ids`` in order from ``prev`` (no key needed); the last digest."""
    with log.db.session() as session:
        stored = [session.get(AuditEvent, i) for i in event_ids]
        copies = [AuditEvent(id=e.id, **{column: getattr(e, column) for column in CHAIN_COLUMNS}) for e in stored]
    for copy in copies:
        copy.prev = prev
        prev = copy.digest = chain.entry_digest(copy)
    with log.untriggered() as conn:
        # Through free digests first: the unique index refuses two rows with one digest, even for a moment.
        conn.execute(update(AuditEvent).where(AuditEvent.id.in_(event_ids)).values(digest=None))
        for copy in copies:
            conn.execute(update(AuditEvent).where(AuditEvent.id == copy.id).values(prev=copy.prev, digest=copy.digest))
    return prev


def _set_head(log: Log, **values) -> None:
    with log.db.engine.begin() as conn:  # the head is updated by every append: no trigger stands in the way
        conn.execute(text("UPDATE audit_head SET " + ", ".join(f"{c} = :{c}" for c in values)), values)


def _sign_without_start(log: Log, audit_id: int) -> None:
    """A checkpoint as the store signed them before the chain's start was signed (migration 0016): no ``start``."""
    ring = KeyRing(log.db, log.settings)
    with log.db.session() as session:
        digest = session.get(AuditEvent, audit_id).digest
        kid, key = ring.signing_key(session)
        claims = {"iss": "cgstore", "aud": chain.CHECKPOINT_AUDIENCE, "iat": 0, "audit_id": audit_id, "digest": digest}
        statement = jwt.encode(claims, key, algorithm="EdDSA", headers={"kid": kid, "typ": chain.CHECKPOINT_TYP})
        session.add(AuditCheckpoint(audit_id=audit_id, digest=digest, at=utcnow(), kid=kid, statement=statement))


@pytest.mark.parametrize("signed", ["start signed", "checkpoint from before 0016"])
def test_a_prefix_unchained_and_rechained_from_a_new_genesis_is_named(log, signed):
    """Clear digest and prev of every entry up to the last checkpoint, edit one and delete one, start a new
    genesis at the next entry, recompute the digests to the end and fix the head: no key needed."""
    ids = log.write(6)
    if signed == "start signed":
        _checkpoint(log)
    else:
        _sign_without_start(log, ids[-1])
    ids = log.write(10)  # every id, the 10 new ones included
    with log.untriggered() as conn:
        conn.execute(update(AuditEvent).where(AuditEvent.id <= ids[5]).values(digest=None, prev=None))
        conn.execute(update(AuditEvent).where(AuditEvent.id == ids[2]).values(outcome="ok-rewritten"))
        conn.execute(delete(AuditEvent).where(AuditEvent.id == ids[3]))
    last = _rechain(log, ids[6:], chain.GENESIS)
    _set_head(log, digest=last)
    if signed == "start signed":
        _verify_fails(log, ids[0], f"unchained (its digest was removed; the chain starts at entry {ids[0]})")
    else:  # nothing signs the start: the head's is moved too, and the checkpoint's entry tells
        _set_head(log, start_id=ids[6])
        _verify_fails(log, ids[5], "unchained (its digest was removed; the signed checkpoint names it)")


def test_every_digest_cleared_and_the_head_reset_is_named_with_100_entries_deleted(log):
    ids = log.write(60)
    _checkpoint(log)  # entry 60: among those deleted below
    ids = log.write(60)
    with log.untriggered() as conn:
        conn.execute(update(AuditEvent).values(digest=None, prev=None))
        conn.execute(delete(AuditEvent).where(AuditEvent.id.between(ids[10], ids[109])))
    _set_head(log, last_id=ids[-1], digest=chain.GENESIS)
    _verify_fails(log, ids[0], f"unchained (its digest was removed; the chain starts at entry {ids[0]})")
    # From the checkpoint on, the unchained entries after the gap do not count as reaching it: it is missing.
    result = log.cli("verify", "--since", str(ids[59]))
    assert result.exit_code == 1, result.output
    assert f"broken at entry {ids[59]}: entry missing (the signed checkpoint names it)" in result.output


def test_a_checkpoint_signing_another_start_is_named(log):
    ids = log.write(3)
    _checkpoint(log)
    _set_head(log, start_id=ids[1])
    ids = log.write(2)
    _checkpoint(log)  # signs the head's (moved) start
    _verify_fails(log, ids[-1], f"checkpoint signs another chain start (entry {ids[1]}, not entry {ids[0]})")


def test_the_migration_records_where_the_chain_starts(empty_url, tmp_path):
    """A log chained since 0011 starts at its first entry with a digest, whatever came before."""
    migrate.upgrade(empty_url, "0009_scrub")
    db = Database(empty_url)
    try:
        with db.engine.begin() as conn:
            for old_id in (7, 9):
                conn.execute(
                    text(
                        "INSERT INTO audit_events (id, at, actor, action, target, outcome, count, detail) "
                        "VALUES (:id, CURRENT_TIMESTAMP, 'old', 'test.old', 't', 'ok', 1, '{}')"
                    ),
                    {"id": old_id},
                )
        migrate.upgrade(empty_url, "0015_audit_action_pages")
        log = Log(db, Settings(home=tmp_path / "home", database_url=empty_url))
        assert log.write(2) == [7, 9, 10, 11]
        migrate.upgrade(empty_url)
        _checkpoint(log)
        with db.session() as session:
            assert session.get(AuditCheckpoint, 11).start_id == 10
        assert "2 entries from before the chain" in log.cli("verify").output
        with log.untriggered() as conn:
            conn.execute(update(AuditEvent).where(AuditEvent.id == 10).values(digest=None, prev=None))
        _rechain(log, [11], chain.GENESIS)
        _verify_fails(log, 10, "unchained (its digest was removed; the chain starts at entry 10)")
    finally:
        db.dispose()


def _save(log: Log, path: Path) -> dict:
    result = log.cli("checkpoint", "--save", str(path))
    assert result.exit_code == 0 and f"to {path}" in result.output, result.output
    return json.loads(path.read_text())


def test_a_saved_checkpoint_verifies_offline_and_an_extended_log_extends_it(log, tmp_path):
    ids = log.write(3)
    saved = _save(log, tmp_path / "cp.json")
    # Offline: the file alone verifies (its JWK), and the signed claims are the entry's.
    claims = jwt.decode(
        saved["statement"], jwt.PyJWK(saved["jwk"]).key, algorithms=["EdDSA"], audience=chain.CHECKPOINT_AUDIENCE
    )
    assert (claims["audit_id"], claims["start"]) == (ids[-1], ids[0])
    ids = log.write(4)
    result = log.cli("verify", "--since-checkpoint", str(tmp_path / "cp.json"))
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(f"it extends the saved checkpoint of entry {ids[2]}")
    assert _save(log, tmp_path / "cp.json")["audit_id"] == ids[-1]  # signs the moved head, saves that


def test_a_saved_checkpoint_must_verify(log, tmp_path):
    log.write(3)
    saved = _save(log, tmp_path / "cp.json")
    header, claims, signature = saved["statement"].split(".")
    (tmp_path / "forged.json").write_text(json.dumps({**saved, "statement": f"{header}.{claims}.{signature[:-4]}AAAA"}))
    result = log.cli("verify", "--since-checkpoint", str(tmp_path / "forged.json"))
    assert result.exit_code == 1 and "saved checkpoint signature bad" in result.output, result.output
    other = Ed25519PrivateKey.generate().public_key()
    (tmp_path / "other.json").write_text(json.dumps({"keys": [jwk(key_id(other), other)]}))
    result = log.cli("verify", "--since-checkpoint", str(tmp_path / "cp.json"), "--keys", str(tmp_path / "other.json"))
    assert result.exit_code == 1 and "saved checkpoint signature bad (unknown key" in result.output, result.output
    (tmp_path / "junk.json").write_text('{"keys": []}')
    result = log.cli("verify", "--since-checkpoint", str(tmp_path / "junk.json"))
    assert result.exit_code == 2 and "not a saved checkpoint" in result.output, result.output


def test_nothing_is_saved_before_a_checkpoint_exists(log, tmp_path):
    result = log.cli("checkpoint", "--save", str(tmp_path / "cp.json"))
    assert result.exit_code == 1 and "not saved: no checkpoint signed yet" in result.output, result.output
    assert not (tmp_path / "cp.json").exists()


@pytest.mark.parametrize("then", ["truncated", "truncated and refilled"])
def test_a_tail_cut_behind_a_saved_checkpoint_is_named(log, tmp_path, then):
    """Delete the entries after a checkpoint (and the checkpoints naming them) and fix the head: the log alone
    still verifies, but it no longer extends the checkpoint the verifier saved."""
    ids = log.write(5)
    _checkpoint(log)
    ids = log.write(3)
    _save(log, tmp_path / "cp.json")  # signs and saves entry 8
    ids = log.write(2)
    with log.db.session() as session:
        kept = session.get(AuditEvent, ids[4]).digest
    with log.untriggered() as conn:
        conn.execute(delete(AuditEvent).where(AuditEvent.id > ids[4]))
        conn.execute(delete(AuditCheckpoint).where(AuditCheckpoint.audit_id > ids[4]))
    _set_head(log, last_id=ids[4], digest=kept)
    if then == "truncated and refilled":
        log.write(5)  # the store appends on from the cut: entry 8 exists again, with another digest
    assert log.cli("verify").exit_code == 0  # what the database alone cannot tell
    result = log.cli("verify", "--since-checkpoint", str(tmp_path / "cp.json"))
    assert result.exit_code == 1, result.output
    if then == "truncated":
        assert (
            f"broken at entry {ids[5]}: entry missing (the saved checkpoint names entry {ids[7]}; "
            f"the chain ends at entry {ids[4]})"
        ) in result.output
    else:
        assert (
            f"broken at entry {ids[7]}: content edited (its digest differs from the saved checkpoint's)"
            in result.output
        )
