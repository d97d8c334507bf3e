"""Strict request input (issue 15, item 2): one JSON parser, one rule for text, a JSON last resort.

Every JSON body goes through the client's ``strict_json_loads`` after a strict
UTF-8 decode (duplicate keys, NaN/Infinity, other encodings → 400
``BAD_REQUEST``); NUL and lone surrogates are refused in bodies and query values
before any query (PostgreSQL used to answer 500 for them); an unexpected
exception still answers the protocol's JSON body and moves
``cgstore_internal_errors_total``. Both configurations (``store``).
"""

from __future__ import annotations

import json
import re
import uuid

import blake3
import pytest

from tests.compiled_graphs.support import CONSTANTS_A, publication, publish, safetensors_bytes, upload_all
from tests.security.conftest import code
from tests.support.archives import archive_report
from tests.support.live_store import unique_repo

KEY = "ck1-" + "0" * 56


def _slug() -> str:
    return f"strict-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def claimer(store):
    return store.mint(f"tenant-{uuid.uuid4().hex[:8]}", "*/*:owner:create,read,write")


@pytest.fixture
def admin(store):
    return store.mint("strict-admin", "*/*:admin")


@pytest.fixture
def repo(store):
    """``acme/<name>`` holding one blob, and a read/write token for it."""
    name = unique_repo("strict")
    token = store.mint("strict", f"acme/{name}:read,write")
    data = f"bytes of {name}".encode()
    with store.client(token) as client:
        digest = "blake3:" + blake3.blake3(data).hexdigest()
        assert client.put(f"/v1/repos/acme/{name}/blobs/{digest}", content=data).status_code == 201
    return name, token


def _publication(archive):
    """A publication admission accepts (201) as it stands."""
    return publication(archive, archive_report(archive), components={"consts": safetensors_bytes(CONSTANTS_A)})


def _refused(response, status: int = 400) -> None:
    assert response.status_code == status, response.text
    assert code(response) == "BAD_REQUEST"


def test_a_duplicated_key_is_refused_not_judged_by_its_last_copy(store, claimer):
    body = f'{{"slug": "{_slug()}", "slug": "root"}}'
    with store.client(claimer) as client:
        response = client.post("/v1/owners", content=body, headers={"Content-Type": "application/json"})
    _refused(response)
    assert "duplicate" in response.json()["error"]["detail"]["reason"]


def test_a_utf16_body_is_refused(store, claimer):
    slug = _slug()
    body = f'{{"slug": "{slug}"}}'.encode("utf-16")
    with store.client(claimer) as client:
        response = client.post("/v1/owners", content=body, headers={"Content-Type": "application/json"})
        _refused(response)
        # Nothing was claimed: the same slug, sent as UTF-8, is still free.
        assert client.post("/v1/owners", json={"slug": slug}).status_code == 201


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_in_a_json_field_are_refused(store, pt2_archive, constant):
    name = unique_repo("strict")
    token = store.mint("strict", f"acme/{name}:read,write")
    pub = _publication(pt2_archive)
    pub.manifest["evidence"]["mint_phases"]["compile_s"] = "@constant@"
    body = json.dumps(pub.manifest).replace('"@constant@"', constant)
    with store.client(token) as client:
        upload_all(client, "acme", name, pub)
        response = client.put(pub.path("acme", name), content=body, headers={"Content-Type": "application/json"})
        _refused(response)
        assert client.get(pub.path("acme", name)).status_code == 404


@pytest.mark.parametrize("text", ["fam\x00ily", "fam\ud800ily"], ids=["nul", "lone-surrogate"])
def test_unstorable_text_in_a_resolve_family_is_refused(store, repo, text):
    _, token = repo
    body = f'{{"family": {_escaped(text)}, "keys": ["{KEY}"]}}'
    with store.client(token) as client:
        response = client.post(
            "/v1/compiled-graphs:resolve", content=body, headers={"Content-Type": "application/json"}
        )
    _refused(response)


def _escaped(text: str) -> str:
    """``text`` as a JSON string literal, lone surrogates as ``\\uXXXX`` escapes (as a hostile client sends them)."""
    return '"' + "".join(c if " " <= c < "\x7f" and c not in '"\\' else f"\\u{ord(c):04x}" for c in text) + '"'


@pytest.mark.parametrize("parameter", ["family", "sm", "lane"])
def test_nul_in_a_listing_filter_is_refused(store, repo, parameter):
    name, token = repo
    with store.client(token) as client:
        response = client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={parameter: "a\x00b"})
    _refused(response)


def test_nul_in_a_token_listing_subject_is_refused(store, admin):
    with store.client(admin) as client:
        response = client.get("/v1/tokens", params={"sub": "mall\x00ory"})
    _refused(response)


def test_nul_in_a_yank_reason_is_refused_and_the_record_stays_live(store, admin, pt2_archive):
    name = unique_repo("strict")
    token = store.mint("strict", f"acme/{name}:read,write")
    pub = _publication(pt2_archive)
    with store.client(token) as client:
        assert publish(client, "acme", name, pub).status_code == 201
    with store.client(admin) as client:
        response = client.post(pub.path("acme", name) + ":yank", json={"reason": "bad\x00build"})
        _refused(response)
    with store.client(token) as client:
        record = client.get(pub.path("acme", name))
    assert record.status_code == 200 and record.json().get("yank") is None


def _internal_errors(store) -> float:
    line = re.search(r"^cgstore_internal_errors_total (\S+)$", store.scrape_metrics(), re.MULTILINE)
    return float(line.group(1)) if line else 0.0


def test_an_unexpected_failure_answers_json_internal_and_is_counted(store, admin, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("secret path /srv/cgstore/boom")

    # A fault in any service: the route has no handler of its own for it.
    monkeypatch.setattr(store.context.tokens, "list_tokens", fail)
    with store.client(admin) as client:
        before = _internal_errors(store)
        response = client.get("/v1/tokens")
        assert response.status_code == 500
        assert response.json() == {"error": {"code": "INTERNAL", "message": "internal error", "detail": {}}}
        assert "secret" not in response.text
        assert _internal_errors(store) == before + 1


#: Spellings pydantic reads as 4 (or 40) that are no plain ASCII decimal.
NOT_ASCII_DIGITS = ["+4", " 4", "4_0", "4.0"]


@pytest.mark.parametrize("value", NOT_ASCII_DIGITS, ids=["plus", "space", "underscore", "float"])
def test_a_query_integer_is_ascii_digits_only(store, repo, admin, value):
    """Every integer query parameter of the API (``limit`` of three listings, preflight's ``min_ttl_s``)."""
    name, token = repo
    with store.client(admin) as client:
        refused = [client.get("/v1/tokens", params={"limit": value}), client.get("/v1/audit", params={"limit": value})]
        assert client.get("/v1/tokens", params={"limit": "4"}).status_code == 200
        assert client.get("/v1/audit", params={"limit": "4"}).status_code == 200
    with store.client(token) as client:
        refused += [
            client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={"limit": value}),
            client.post(f"/v1/repos/acme/{name}/preflight", params={"min_ttl_s": value}),
        ]
        assert client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={"limit": "4"}).status_code == 200
        assert client.post(f"/v1/repos/acme/{name}/preflight", params={"min_ttl_s": "60"}).status_code == 204
    for response in refused:
        _refused(response)
