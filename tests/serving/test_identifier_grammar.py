"""Identifiers are checked by their grammar before any query (issue 9, class 3).

PostgreSQL refuses NUL in text, so a session id, digest or name carrying
``%00`` that reached a query answered 500. Every identifier a route takes is
validated first: a malformed session id answers ``BLOB_UPLOAD_UNKNOWN`` exactly
like an unknown one, a malformed digest ``DIGEST_INVALID``, a malformed name
``NAME_INVALID``. Both configurations: the 500 was PostgreSQL's.
"""

from __future__ import annotations

import blake3
import pytest

from tests.support.live_store import unique_repo

# Path segments, already percent-encoded as a hostile client sends them.
BAD_SESSION_IDS = [
    "%00",
    "0123456789abcdef0123456789abcde%00",  # a well-formed id's length, one byte a NUL
    "0123456789abcdef0123456789abcdef%00",
    "0123456789ABCDEF0123456789ABCDEF",  # upper case is not the grammar
    "a" * 65,  # longer than the column
    "a" * 5000,
    "%C3%A9" * 16,  # non-ASCII
    "%FF%FE",  # not even UTF-8
    "%2E%2E",  # decoded to ".." after the client's own dot-segment removal
]


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def assert_error(response, status: int, code: str) -> None:
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == code


@pytest.fixture
def repo(store):
    name = unique_repo()
    return name, store.mint("alice", f"acme/{name}:read,write")


@pytest.mark.parametrize("bad", BAD_SESSION_IDS, ids=lambda bad: bad[:40])
def test_malformed_session_id_is_an_unknown_session(store, repo, bad):
    name, token = repo
    url = f"/v1/repos/acme/{name}/uploads/{bad}"
    with store.client(token) as client:
        real = client.post(f"/v1/repos/acme/{name}/uploads")  # a live session exists in the repo
        assert real.status_code == 202
        for method in ("GET", "PATCH", "PUT", "DELETE"):
            response = client.request(
                method, url, params={"digest": digest_of(b"")}, content=b"x", headers={"Content-Range": "0-0"}
            )
            assert_error(response, 404, "BLOB_UPLOAD_UNKNOWN")
            echoed = response.json()["error"]["detail"]["session"]
            assert echoed.isascii() and "\x00" not in echoed and len(echoed) <= 64
        # The refusals touched nothing: the real session is still there, at offset 0.
        assert client.get(real.headers["location"]).headers["upload-offset"] == "0"


@pytest.mark.parametrize("bad", ["%00", "blake3:" + "0" * 63 + "%00", "blake3:" + "%C3%A9" * 32, "b" * 5000])
def test_malformed_digest_in_path_query_and_body_is_digest_invalid(store, repo, bad):
    name, token = repo
    with store.client(token) as client:
        assert client.head(f"/v1/repos/acme/{name}/blobs/{bad}").status_code == 400  # HEAD has no body
        assert_error(client.get(f"/v1/repos/acme/{name}/blobs/{bad}"), 400, "DIGEST_INVALID")
        assert_error(client.put(f"/v1/repos/acme/{name}/blobs/{bad}", content=b"x"), 400, "DIGEST_INVALID")
        mount = client.post(f"/v1/repos/acme/{name}/blobs/{bad}:mount", params={"from": f"acme/{name}"})
        assert_error(mount, 400, "DIGEST_INVALID")
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        # The query string is sent raw, so %00 arrives as a NUL byte: in a query value or a
        # JSON body, the one input rule (core/inputs.py) refuses it before any digest grammar.
        text_code = "BAD_REQUEST" if "%00" in bad else "DIGEST_INVALID"
        assert_error(client.put(f"{location}?digest={bad}"), 400, text_code)
        nul = bad.replace("%00", "\x00")
        missing = client.post(f"/v1/repos/acme/{name}/blobs:missing", json={"digests": [nul]})
        assert_error(missing, 400, text_code)


@pytest.mark.parametrize("bad", ["ac%00me", "%C3%A1cme", "a" * 5000])
def test_malformed_names_are_name_invalid(store, bad):
    token = store.mint("alice", "acme/*:read,write")
    digest = digest_of(b"x")
    with store.client(token) as client:
        assert_error(client.get(f"/v1/repos/{bad}/r/blobs/{digest}"), 400, "NAME_INVALID")
        assert_error(client.get(f"/v1/repos/acme/{bad}/blobs/{digest}"), 400, "NAME_INVALID")
        assert_error(client.post(f"/v1/repos/acme/{bad}/uploads"), 400, "NAME_INVALID")
        mount = client.post(f"/v1/repos/acme/r/blobs/{digest}:mount?from=acme/{bad}")
        # A NUL in a query value meets the one input rule first (core/inputs.py).
        assert_error(mount, 400, "BAD_REQUEST" if "%00" in bad else "NAME_INVALID")
