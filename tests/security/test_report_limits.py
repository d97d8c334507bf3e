"""Drift reports cannot be multiplied by attenuation, piled on someone else's record, or padded (issue 30 §3).

Before, the limit counted per token: five attenuated children of one token
made 50 reports in one 60 s window, a ``*/*:read`` token could raise another
owner's ``drift_reports`` by 10 a minute, and every report could carry a
1,000-character reason into the audit log. Now a window counts per principal
(``sub``, which attenuation keeps: the root of the chain) and per record, and
a reason longer than ``MAX_REPORT_REASON_CHARS`` is refused with 422
``METADATA_INVALID`` before anything is written. Both configurations.
"""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import func, select

from cgstore.audit.models import AuditEvent
from cgstore.compiled_graphs.models import CompiledGraph
from cgstore.compiled_graphs.reports import MAX_REPORT_REASON_CHARS, REPORTS_PER_RECORD, REPORTS_PER_WINDOW
from tests.compiled_graphs.support import (
    CONSTANTS_A,
    clone_record,
    publication,
    publish,
    safetensors_bytes,
    unique_envelope,
)
from tests.security.conftest import code
from tests.support.archives import archive_report
from tests.support.live_store import unique_repo

#: Records to spread reports over, so that the principal's limit is met before any record's.
RECORDS = -(-(REPORTS_PER_WINDOW + 1) // REPORTS_PER_RECORD)


def principal(role: str) -> str:
    """A principal no other test (or earlier run of this one) reports as: a window counts per principal."""
    return f"{role}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def records(store, pt2_archive):
    """``RECORDS`` live records of the owner ``acme`` in a fresh repo: one published, the rest its clones."""
    name = unique_repo("reports")
    pub = publication(
        pt2_archive,
        archive_report(pt2_archive),
        components={"consts": safetensors_bytes(CONSTANTS_A)},
        envelope=unique_envelope(),
    )
    with store.client(store.mint(principal("owner"), f"acme/{name}:read,write")) as client:
        assert publish(client, "acme", name, pub).status_code == 201
    with store.context.db.session() as session:
        repo_id = session.scalar(select(CompiledGraph.repo_id).where(CompiledGraph.key == pub.key))
    keys = [pub.key] + [clone_record(store, pub.key, repo_id=repo_id) for _ in range(RECORDS - 1)]
    return name, keys


def report(client, name: str, key: str, reason: str = "confirmation measured another graph"):
    return client.post(
        f"/v1/repos/acme/{name}/compiled-graphs/{key}:report",
        json={"measured_graph": "blake3:" + "e" * 64, "reason": reason},
    )


def drift_reports(store, name: str, key: str) -> int:
    with store.context.db.session() as session:
        return session.scalar(
            select(CompiledGraph.drift_reports).where(CompiledGraph.key == key, CompiledGraph.yanked_at.is_(None))
        )


def report_entries(store, name: str) -> int:
    with store.context.db.session() as session:
        return session.scalar(
            select(func.count())
            .select_from(AuditEvent)
            .where(AuditEvent.action == "compiled_graph.report", AuditEvent.repo == f"acme/{name}")
        )


def test_attenuated_children_share_their_principals_limit(store, records):
    name, keys = records
    parent = store.mint(principal("worker"), f"acme/{name}:read")
    children = []
    with store.client(parent) as client:
        for _ in range(5):
            answer = client.post(
                "/v1/tokens/attenuate", json={"grants": [{"repo": f"acme/{name}", "actions": ["read"]}], "ttl_s": 600}
            )
            assert answer.status_code in (200, 201), answer.text
            children.append(answer.json()["token"])
    statuses = []
    for sent in range(REPORTS_PER_WINDOW + 5):  # round robin over the children, at most REPORTS_PER_RECORD per record
        with store.client(children[sent % len(children)]) as client:
            answer = report(client, name, keys[sent // REPORTS_PER_RECORD % len(keys)])
        statuses.append(answer.status_code)
        if answer.status_code == 429:
            assert code(answer) == "UNAVAILABLE" and answer.json()["error"]["detail"]["per"] == "principal"
            assert 1 <= int(answer.headers["Retry-After"]) <= 60
    assert statuses == [200] * REPORTS_PER_WINDOW + [429] * 5
    assert sum(drift_reports(store, name, key) for key in keys) == REPORTS_PER_WINDOW
    assert report_entries(store, name) == REPORTS_PER_WINDOW  # a refused report leaves no entry


def test_a_wildcard_reader_cannot_inflate_another_owners_record(store, records):
    """Several ``*/*:read`` principals together raise one record by at most ``REPORTS_PER_RECORD`` per window;
    the owner's other records, and its own reports on them, are unaffected."""
    name, keys = records
    readers = [store.mint(principal("mallory"), "*/*:read") for _ in range(2)]
    statuses = []
    for sent in range(REPORTS_PER_RECORD + 4):
        with store.client(readers[sent % 2]) as client:
            answer = report(client, name, keys[0])
        statuses.append(answer.status_code)
        if answer.status_code == 429:
            assert code(answer) == "UNAVAILABLE" and answer.json()["error"]["detail"]["per"] == "record"
    assert statuses == [200] * REPORTS_PER_RECORD + [429] * 4
    assert drift_reports(store, name, keys[0]) == REPORTS_PER_RECORD
    with store.client(store.mint(principal("worker"), f"acme/{name}:read")) as client:
        assert report(client, name, keys[1]).status_code == 200  # another record: its own window


def test_one_tenants_reports_do_not_count_against_anothers_record_of_the_key(store, pt2_archive):
    """In a private cache each publisher's record of a key is its own: alice exhausting hers leaves bob's
    open (were they one, bob's 429 would tell him alice holds the key)."""
    name = unique_repo("reports-private")
    with store.client(store.mint("ops", f"acme/{name}:admin")) as client:
        assert client.put(f"/v1/repos/acme/{name}", json={"visibility": "principal"}).status_code == 201
    pub = publication(
        pt2_archive,
        archive_report(pt2_archive),
        components={"consts": safetensors_bytes(CONSTANTS_A)},
        envelope=unique_envelope(),
    )
    alice = store.mint(principal("alice"), f"acme/{name}:read,write")
    bob = store.mint(principal("bob"), f"acme/{name}:read,write")
    for token in (alice, bob):
        with store.client(token) as client:
            assert publish(client, "acme", name, pub).status_code == 201
    with store.client(alice) as client:
        assert [report(client, name, pub.key).status_code for _ in range(REPORTS_PER_RECORD + 1)] == [
            200
        ] * REPORTS_PER_RECORD + [429]
    with store.client(bob) as client:
        answer = report(client, name, pub.key)
    assert answer.status_code == 200, answer.text
    assert answer.json()["drift_reports"] == 1


def test_an_over_long_reason_is_refused_and_nothing_is_stored(store, records):
    name, keys = records
    worker = store.mint(principal("worker"), f"acme/{name}:read")
    with store.client(worker) as client:
        refused = report(client, name, keys[0], reason="x" * (MAX_REPORT_REASON_CHARS + 1))
        assert refused.status_code == 422, refused.text
        assert code(refused) == "METADATA_INVALID"
        assert refused.json()["error"]["detail"] == {"field": "reason", "limit": MAX_REPORT_REASON_CHARS}
        assert drift_reports(store, name, keys[0]) == 0 and report_entries(store, name) == 0
        assert report(client, name, keys[0], reason="x" * MAX_REPORT_REASON_CHARS).status_code == 200
    assert drift_reports(store, name, keys[0]) == 1
