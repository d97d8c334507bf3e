"""Issue 9, class 2: every route, walked with malformed headers, answers no 500 and only JSON errors.

The routes come from the app itself (``app.routes``), so a route added later is
walked too. Path parameters are filled with valid names (an existing blob, an
open session); each request then carries one malformed part: numbers of
thousands of digits in ``Range``/``Content-Range``/``Content-Length``/queries,
garbage and obs-text bytes where HTTP allows them, control bytes where it does
not, and every bad form of ``Authorization``. Every answer must be below 500,
and every error body the protocol's ``{"error": {"code", "message", "detail"}}``
(HEAD answers have no body to check). The console's routes may answer a page
instead: a person's browser reads those, and the console answers its refusals
with an HTML page (what the HTTP parser refuses before any route is known stays
JSON). Requests are sent over raw sockets so the
bytes on the wire are exactly the malformed ones.
"""

from __future__ import annotations

import json
import re
import socket

import pytest
from fastapi.routing import iter_route_contexts

from tests.blobs.test_blobs_api import digest_of
from tests.support.live_store import CONFIGURATIONS, unique_repo

HUGE = b"9" * 5000

#: name -> (headers to add, header names they replace, query to append)
CASES: dict[str, tuple[list[tuple[bytes, bytes]], set[bytes], bytes]] = {
    "clean": ([], set(), b""),
    "huge-digit range": ([(b"Range", b"bytes=" + HUGE + b"-")], set(), b""),
    "huge-digit suffix range": ([(b"Range", b"bytes=-" + HUGE)], set(), b""),
    "huge-digit range end": ([(b"Range", b"bytes=0-" + HUGE)], set(), b""),
    "obs-text range": ([(b"Range", b"bytes=\xff\xfe-\x80")], set(), b""),
    "several ranges": ([(b"Range", b"bytes=0-1," * 200 + b"5-6")], set(), b""),
    "huge-digit content-range": ([(b"Content-Range", b"0-" + HUGE)], set(), b""),
    "huge-digit content-range total": ([(b"Content-Range", b"0-1/" + HUGE)], set(), b""),
    "garbage content-range": ([(b"Content-Range", b"\xffbytes */*")], set(), b""),
    "backwards content-range": ([(b"Content-Range", b"5-1")], set(), b""),
    "huge-digit content-length": ([(b"Content-Length", HUGE)], {b"content-length"}, b""),
    "negative content-length": ([(b"Content-Length", b"-1")], {b"content-length"}, b""),
    "latin-1 digit content-length": ([(b"Content-Length", b"\xb2")], {b"content-length"}, b""),
    "content-length over the blob limit": ([(b"Content-Length", b"9" * 18)], {b"content-length"}, b""),
    "two content-lengths": ([(b"Content-Length", b"2"), (b"Content-Length", b"3")], {b"content-length"}, b""),
    "no token": ([], {b"authorization"}, b""),
    "token without scheme": ([(b"Authorization", b"eyJhbGciOiJFZERTQSJ9.e30.c2ln")], {b"authorization"}, b""),
    "basic credentials": ([(b"Authorization", b"Basic YWxpY2U6cGFzcw==")], {b"authorization"}, b""),
    "empty bearer": ([(b"Authorization", b"Bearer ")], {b"authorization"}, b""),
    "obs-text bearer": ([(b"Authorization", b"Bearer \xff\xfe\xfd.\x80.\x81")], {b"authorization"}, b""),
    "garbage bearer": ([(b"Authorization", b"Bearer a.b.c")], {b"authorization"}, b""),
    "huge bearer": ([(b"Authorization", b"Bearer " + b"A" * 20000)], {b"authorization"}, b""),
    "two authorizations": ([(b"Authorization", b"Bearer x")], set(), b""),
    "obs-text in other headers": (
        [(b"Accept", b"\xff\xfe"), (b"If-None-Match", b'"\x80"'), (b"X-Note", b"caf\xe9")],
        set(),
        b"",
    ),
    "obs-text content-type": ([(b"Content-Type", b"application/json; charset=\xff")], {b"content-type"}, b""),
    "NUL in a header": ([(b"X-Note", b"a\x00b")], set(), b""),
    "control byte in a header": ([(b"X-Note", b"a\x01b")], set(), b""),
    "huge-digit query": ([], set(), b"digest=" + HUGE + b"&from=" + HUGE + b"&limit=" + HUGE + b"&min_ttl_s=" + HUGE),
    "obs-text query": ([], set(), b"digest=%FF%FE&from=%C0%AF&cursor=%80"),
}


def _routes(app) -> list[tuple[str, str, list[str]]]:
    """(method, path template, query parameter names) of every route the app serves."""
    found = []
    for route in iter_route_contexts(app.routes):
        dependant = getattr(route, "dependant", None)
        queries = [param.alias for param in dependant.query_params] if dependant else []
        for method in sorted(route.methods or ()):
            found.append((method, route.path, queries))
    return found


def _send(address: tuple[str, int], request: bytes) -> bytes:
    with socket.create_connection(address) as sock:
        sock.sendall(request)
        sock.settimeout(20)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def _check(answer: bytes, method: str, template: str, what: str) -> int:
    assert answer.startswith(b"HTTP/1.1 "), (what, answer[:200])
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert status < 500, (what, head, body[:300])
    if status >= 400 and method != "HEAD":
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:])
        }
        if template.startswith("/console") and headers.get(b"content-type", b"").startswith(b"text/html"):
            assert b"<h1>" in body, (what, body[:300])
            return status
        assert headers.get(b"content-type", b"").startswith(b"application/json"), (what, head)
        error = json.loads(body)
        assert set(error) == {"error"}, (what, error)
        assert set(error["error"]) == {"code", "message", "detail"}, (what, error)
        assert isinstance(error["error"]["code"], str) and re.fullmatch(r"[A-Z_]+", error["error"]["code"])
        assert isinstance(error["error"]["message"], str) and isinstance(error["error"]["detail"], dict)
    return status


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_every_route_answers_malformed_headers_with_json_errors(make_store, configuration):
    live = make_store(configuration, body_idle_timeout_s=1.0, redirect_downloads=False)
    name = unique_repo()
    token = live.mint("alice", f"acme/{name}:read,write", "acme/*:read")
    data = b"walked"
    host, port = live.base_url.removeprefix("http://").split(":")
    address = (host, int(port))
    with live.client(token) as client:
        assert client.put(f"/v1/repos/acme/{name}/blobs/{digest_of(data)}", content=data).status_code == 201
        sessions = [client.post(f"/v1/repos/acme/{name}/uploads").headers["location"] for _ in range(3)]
    values = {"owner": "acme", "repo": name, "digest": digest_of(data), "from": f"acme/{name}"}
    routes = _routes(live.server.config.app)
    assert ("PATCH", "/v1/repos/{owner}/{repo}/uploads/{session_id}", []) in routes  # the walk sees routers
    # Two paths no route serves: the 404 and 405 answers are errors too.
    routes += [("GET", "/v1/no-such-route", []), ("DELETE", "/v1/capabilities", [])]

    statuses: dict[tuple[str, str], set[int]] = {}
    for method, template, queries in routes:
        for what, (extra, replaced, bad_query) in CASES.items():
            session = sessions[len(statuses) % len(sessions)].rsplit("/", 1)[1]
            path = re.sub(
                r"{(\w+)(?::\w+)?}",
                lambda m: values.get(m.group(1), session if m.group(1) == "session_id" else "x"),
                template,
            )
            query = "&".join(f"{q}={values.get(q, '1')}" for q in queries).encode()
            query = bad_query or query
            body = b'{"digests": []}' if method in ("POST", "PUT", "PATCH") else b""
            headers = [
                (b"Host", b"store"),
                (b"Connection", b"close"),
                (b"Authorization", f"Bearer {token}".encode()),
                (b"Content-Type", b"application/json"),
                (b"Content-Length", str(len(body)).encode()),
            ]
            headers = [(k, v) for k, v in headers if k.lower() not in replaced] + extra
            target = path.encode() + (b"?" + query if query else b"")
            request = b"%s %s HTTP/1.1\r\n" % (method.encode(), target)
            request += b"".join(b"%s: %s\r\n" % header for header in headers) + b"\r\n" + body
            status = _check(_send(address, request), method, template, f"{what}: {method} {template}")
            statuses.setdefault((method, template), set()).add(status)
    # The walk reached the handlers: every /v1 route answered more than one kind of status.
    for (method, template), seen in statuses.items():
        if template.startswith("/v1/repos"):
            assert len(seen) > 1, (method, template, seen)
