"""Nothing stored can break a later read, and no query value reaches the database outside its domain.

Issue 15 §2, on both configurations: a publish whose free-form fields nest too
deep or are too large is refused with 422 ``METADATA_INVALID``, one holding a
lone surrogate with 400 ``BAD_REQUEST`` by the one text rule (before, it was stored and every later read of the record
and the listing answered a plain-text 500); an envelope number past any decimal
context is 422 ``ENVELOPE_INVALID`` (was ``decimal.Overflow``); an audit cursor
past int64 and an audit time with no UTC spelling are 400 ``BAD_REQUEST`` (were
overflows in the database driver), and so is a bare id as a listing cursor
(listing cursors are opaque; the int64 edge is sealed by the store). After every refusal the record and the
listing still answer JSON.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from cgstore_client.wire.records import MAX_FREE_FORM_BYTES, MAX_FREE_FORM_DEPTH, Record, RecordPage
from tests.compiled_graphs.support import publication, publish, upload_all
from tests.security.conftest import code
from tests.support.live_store import unique_repo

INT64_MAX = 2**63 - 1
_guidance = itertools.count(1)

#: A lone surrogate as JSON spells it: valid JSON text, not a Unicode scalar value.
LONE_SURROGATE = json.loads('"\\ud800"')


def nested(depth: int) -> Any:
    """A JSON document of ``depth`` nested containers."""
    document: Any = "leaf"
    for level in range(depth):
        document = {"k": document} if level % 2 else [document]
    return document


@pytest.fixture(scope="module")
def constants_a() -> bytes:
    from tests.compiled_graphs.support import CONSTANTS_A, safetensors_bytes

    return safetensors_bytes(CONSTANTS_A)


@pytest.fixture
def repo(store, pt2_archive, constants_a):
    """A fresh repo holding one good record; returns (name, token, a factory of further publications)."""
    from tests.support.archives import archive_report

    report = archive_report(pt2_archive)
    name = unique_repo("bounded")
    token = store.mint("minter", f"acme/{name}:read,write")

    def new_publication(**fields: Any):
        envelope = {"shapes": [[64, 64]], "text_len": 77, "guidance": [f"{next(_guidance)}.25"]}
        return publication(pt2_archive, report, components={"consts": constants_a}, envelope=envelope, **fields)

    good = new_publication()
    with store.client(token) as client:
        assert publish(client, "acme", name, good).status_code == 201
    return name, token, good, new_publication


def put_raw(client, name: str, pub) -> Any:
    """PUT the manifest as ASCII-escaped JSON, so a lone surrogate travels as ``\\ud800`` like any client sends it."""
    body = json.dumps(pub.manifest).encode()
    return client.put(pub.path("acme", name), content=body, headers={"content-type": "application/json"})


def assert_reads_still_json(client, name: str, good) -> None:
    """The repo's record and listing answer JSON, as the wire types read them."""
    record = client.get(good.path("acme", name))
    assert record.status_code == 200, record.text
    assert Record.model_validate_json(record.content).key == good.key
    listing = client.get(f"/v1/repos/acme/{name}/compiled-graphs")
    assert listing.status_code == 200, listing.text
    assert [r.key for r in RecordPage.model_validate_json(listing.content).records] == [good.key]


FREE_FORM_CASES = {
    "evidence nested 300 deep": {"evidence": {"kernel_lane_evidence": nested(300)}},
    "evidence one level too deep": {"evidence": {"mint_phases": {"x": nested(MAX_FREE_FORM_DEPTH)}}},
    "evidence too large": {"evidence": {"kernel_lane_evidence": {"x": "a" * MAX_FREE_FORM_BYTES}}},
    "input_contract nested 300 deep": {"input_contract": {"inputs": nested(300)}},
}


@pytest.mark.parametrize("fields", FREE_FORM_CASES.values(), ids=FREE_FORM_CASES.keys())
def test_unservable_free_form_fields_are_refused_at_publish(store, repo, fields):
    name, token, good, new_publication = repo
    bad = new_publication(**fields)
    with store.client(token) as client:
        upload_all(client, "acme", name, bad)
        answer = put_raw(client, name, bad)
        assert answer.status_code == 422, answer.text
        assert code(answer) == "METADATA_INVALID"
        missing = client.get(bad.path("acme", name))
        assert missing.status_code == 404 and code(missing) == "NAME_UNKNOWN"
        assert_reads_still_json(client, name, good)


SURROGATE_CASES = {
    "evidence lone surrogate": {"evidence": {"mint_phases": {"compile_s": LONE_SURROGATE}}},
    "evidence lone surrogate key": {"evidence": {"mint_phases": {LONE_SURROGATE: "1"}}},
}


@pytest.mark.parametrize("fields", SURROGATE_CASES.values(), ids=SURROGATE_CASES.keys())
def test_lone_surrogates_in_free_form_fields_are_refused_before_admission(store, repo, fields):
    """The one text rule (``core/inputs.py``) answers for the whole body before admission reads it: 400."""
    name, token, good, new_publication = repo
    bad = new_publication(**fields)
    with store.client(token) as client:
        upload_all(client, "acme", name, bad)
        answer = put_raw(client, name, bad)
        assert answer.status_code == 400, answer.text
        assert code(answer) == "BAD_REQUEST"
        assert answer.json()["error"]["detail"]["where"] == "request body"
        missing = client.get(bad.path("acme", name))
        assert missing.status_code == 404 and code(missing) == "NAME_UNKNOWN"
        assert_reads_still_json(client, name, good)


def test_free_form_fields_at_the_limits_are_accepted(store, repo):
    name, token, good, new_publication = repo
    at_limit = {"x": nested(MAX_FREE_FORM_DEPTH - 1)}
    pub = new_publication(evidence={"kernel_lane_evidence": at_limit, "mint_phases": {"text": "zürich ✓ 𝄞"}})
    with store.client(token) as client:
        answer = put_raw(client, name, pub)
        assert answer.status_code == 201, answer.text
        record = Record.model_validate_json(client.get(pub.path("acme", name)).content)
    assert record.manifest.evidence.kernel_lane_evidence == at_limit
    assert record.manifest.evidence.mint_phases == {"text": "zürich ✓ 𝄞"}


@pytest.mark.parametrize("guidance", ["1e999999999", "-1E+999999999", "1e-999999999"])
def test_envelope_numbers_past_any_decimal_context_are_refused(store, repo, guidance):
    name, token, good, new_publication = repo
    bad = new_publication()
    bad.manifest["axes"]["envelope"]["guidance"] = [guidance]
    with store.client(token) as client:
        answer = put_raw(client, name, bad)
        assert answer.status_code == 422, answer.text
        assert code(answer) == "ENVELOPE_INVALID"
        assert_reads_still_json(client, name, good)


@pytest.mark.parametrize("cursor", [str(INT64_MAX + 1), "9999999999999999999", str(INT64_MAX), "1"])
def test_a_bare_id_as_listing_cursor_is_refused(store, repo, cursor):
    """Listing cursors are opaque (``core.cursors``): no number, in int64 or past it, is one."""
    name, token, good, _ = repo
    with store.client(token) as client:
        answer = client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={"cursor": cursor})
        assert answer.status_code == 400, answer.text
        assert code(answer) == "BAD_REQUEST"
        # The int64 edge, sealed by the store itself: past every record, the last page is empty.
        last = client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={"cursor": sealed(store, name, INT64_MAX)})
        assert last.status_code == 200 and RecordPage.model_validate_json(last.content).records == []
        assert_reads_still_json(client, name, good)


def sealed(store, name: str, position: int) -> str:
    """The cursor the store would hand out for ``position`` in ``acme/<name>``'s listing."""
    from cgstore.compiled_graphs.records import cursor_scope
    from cgstore.repos.service import find_repo

    with store.context.db.session() as session:
        target = find_repo(session, "acme", name)
        return store.context.cursors.seal(cursor_scope(target), position)


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_audit_cursor_past_int64_is_refused(store, order):
    with store.client(store.mint("auditor", "*/*:admin")) as client:
        answer = client.get("/v1/audit", params={"cursor": "9999999999999999999", "order": order})
        assert answer.status_code == 400, answer.text
        assert code(answer) == "BAD_REQUEST"
        edge = client.get("/v1/audit", params={"cursor": str(INT64_MAX), "order": order, "limit": 1})
        assert edge.status_code == 200, edge.text
        assert isinstance(edge.json()["entries"], list)


@pytest.mark.parametrize(
    "params",
    [
        {"since": "9999-12-31T23:59:59-14:00"},
        {"until": "0001-01-01T00:00:00+14:00"},
        {"since": "0001-01-01T00:00:00+14:00", "until": "9999-12-31T23:59:59-14:00"},
    ],
    ids=["since-after-max", "until-before-min", "both"],
)
def test_audit_times_without_a_utc_spelling_are_refused(store, params):
    with store.client(store.mint("auditor", "*/*:admin")) as client:
        answer = client.get("/v1/audit", params=params)
        assert answer.status_code == 400, answer.text
        assert code(answer) == "BAD_REQUEST"
        ok = client.get("/v1/audit", params={"since": "9999-12-31T23:59:59+00:00", "limit": 1})
        assert ok.status_code == 200 and ok.json()["entries"] == []
