"""The admin console over HTTP (both configurations): sign-in, refusals, headers, every page with real records,
filters, keyset paging, escaping, the audit of console reads. The browser tests are test_console_browser.py."""

from __future__ import annotations

import html
import json
import re
import time
import uuid
from types import SimpleNamespace
from urllib.parse import quote

import blake3
import httpx
import pytest
from markupsafe import escape

from cgstore.audit.models import AuditEvent
from cgstore.blobs.models import BLOB_MISSING, BLOB_OK
from cgstore.console import charts
from cgstore.console.router import COOKIE, CSP
from cgstore.console.service import Aggregates
from cgstore.operations.blob_health import set_blob_health
from tests.audit.conftest import rows
from tests.console.conftest import HOSTILE, HOSTILE_FIELDS, h1, next_link, sign_in

PAGES = ("/console", "/console/records", "/console/audit", "/console/tokens", "/console/storage", "/console/explain")
NAV = ("Overview", "Records", "Audit", "Tokens", "Storage", "Explain")


def _cookie_attributes(answer: httpx.Response) -> dict[str, str]:
    header = answer.headers["set-cookie"]
    parts = [part.strip() for part in header.split(";")]
    assert parts[0].startswith(f"{COOKIE}=")
    return {name.lower(): value for name, _, value in (part.partition("=") for part in parts[1:])}


def _assert_secure_headers(answer: httpx.Response) -> None:
    assert answer.headers["content-security-policy"] == CSP
    assert answer.headers["x-frame-options"] == "DENY"
    assert answer.headers["cache-control"] == "no-store"
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert answer.headers["referrer-policy"] == "no-referrer"


def _record_path(repo: str, key: str) -> str:
    return f"/console/records/{repo}/{key}"


# -- sign-in and sign-out ---------------------------------------------------------------------------


def test_the_sign_in_form(store):
    with store.client() as client:
        page = client.get("/console/login")
    assert page.status_code == 200 and h1(page.text) == "Admin console"
    assert '<form method="post" action="/console/login"' in page.text
    assert re.search(r'<input name="token" type="password"', page.text)
    assert ">Sign in</button>" in page.text
    assert "Sign out" not in page.text  # no navigation before signing in


def test_an_admin_signs_in_with_a_strict_cookie_that_expires_with_the_token(store):
    token = store.mint(f"console-admin-{uuid.uuid4().hex[:6]}", "*/*:admin", ttl_s=1800)
    with httpx.Client(base_url=store.base_url, follow_redirects=False) as client:
        answer = client.post("/console/login", data={"token": token})
        assert answer.status_code == 303 and answer.headers["location"] == "/console"
        attributes = _cookie_attributes(answer)
        assert attributes["path"] == "/console" and attributes["samesite"].lower() == "strict"
        assert "httponly" in attributes and "secure" not in attributes  # plain http here
        assert 1790 <= int(attributes["max-age"]) <= 1800
        overview = client.get("/console")
    assert overview.status_code == 200 and h1(overview.text) == "Overview"
    for label in NAV:
        assert f">{label}</a>" in overview.text
    assert '<form method="post" action="/console/logout"' in overview.text and ">Sign out</button>" in overview.text


def test_the_cookie_is_secure_when_the_console_is_served_over_https(store, admin):
    # uvicorn trusts X-Forwarded-Proto from loopback (its default --forwarded-allow-ips), as from a TLS proxy.
    with httpx.Client(base_url=store.base_url, follow_redirects=False) as client:
        answer = client.post("/console/login", data={"token": admin}, headers={"X-Forwarded-Proto": "https"})
    assert answer.status_code == 303 and "secure" in _cookie_attributes(answer)


def test_a_token_without_admin_sees_a_403_page_and_nothing_else(store):
    sub = f"console-reader-{uuid.uuid4().hex[:6]}"
    reader = store.mint(sub, "acme/*:read,write", "*/*:read")
    with httpx.Client(base_url=store.base_url, follow_redirects=False) as client:
        answer = client.post("/console/login", data={"token": reader})
        assert answer.status_code == 403 and h1(answer.text) == "Forbidden"
        assert "set-cookie" not in answer.headers and not client.cookies
        assert "Sign out" not in answer.text and "/console/records" not in answer.text
        for path in PAGES:
            client.cookies.set(COOKIE, reader, domain="127.0.0.1", path="/console")  # a cookie made by hand
            refused = client.get(path)
            assert refused.status_code == 403 and h1(refused.text) == "Forbidden", path
            assert "/console/records?" not in refused.text
    denied = rows(store, AuditEvent.actor == sub)
    assert [(e.action, e.outcome) for e in denied][:2] == [
        ("POST /console/login", "DENIED"),
        ("GET /console", "DENIED"),
    ]


def test_an_invalid_token_gets_the_form_again_with_the_reason(store):
    with httpx.Client(base_url=store.base_url, follow_redirects=False) as client:
        answer = client.post("/console/login", data={"token": "not-a-token"})
        empty = client.post("/console/login", data={"token": ""})
    assert answer.status_code == 401 and h1(answer.text) == "Admin console"
    assert 'class="error"' in answer.text and "malformed token" in answer.text
    assert "set-cookie" not in answer.headers
    assert empty.status_code == 401 and 'class="error"' in empty.text


def test_a_sign_in_posted_from_another_origin_is_refused(store, admin):
    with httpx.Client(base_url=store.base_url, follow_redirects=False) as client:
        answer = client.post("/console/login", data={"token": admin}, headers={"Origin": "https://evil.example"})
        # Under Referrer-Policy: no-referrer a browser's own form says "Origin: null"; Sec-Fetch-Site tells.
        sandboxed = client.post(
            "/console/login", data={"token": admin}, headers={"Origin": "null", "Sec-Fetch-Site": "cross-site"}
        )
        same = client.post("/console/login", data={"token": admin}, headers={"Origin": store.base_url})
        own_form = client.post(
            "/console/login", data={"token": admin}, headers={"Origin": "null", "Sec-Fetch-Site": "same-origin"}
        )
    assert answer.status_code == sandboxed.status_code == 403 and "set-cookie" not in answer.headers
    assert same.status_code == own_form.status_code == 303


def test_unauthenticated_pages_redirect_to_the_sign_in(store):
    with httpx.Client(base_url=store.base_url, follow_redirects=False) as client:
        for path in (*PAGES, "/console/records/acme/x/ck1-" + "0" * 56):
            answer = client.get(path)
            assert answer.status_code == 303 and answer.headers["location"] == "/console/login", path


def test_sign_out_clears_the_cookie(store, console):
    answer = console.post("/console/logout")
    assert answer.status_code == 303 and answer.headers["location"] == "/console/login"
    assert int(_cookie_attributes(answer)["max-age"]) == 0
    assert not console.cookies
    assert console.get("/console").status_code == 303


def test_an_expired_token_is_signed_out_at_the_next_page(store, console, monkeypatch):
    assert console.get("/console").status_code == 200
    tokens = store.context.tokens
    monkeypatch.setattr(tokens, "_clock", lambda: time.time() + 2 * 3600)  # past the token's hour
    answer = console.get("/console/records")
    assert answer.status_code == 303 and answer.headers["location"] == "/console/login"
    assert int(_cookie_attributes(answer)["max-age"]) == 0


def test_a_revoked_token_is_signed_out_at_the_next_page(store):
    token = store.mint(f"console-admin-{uuid.uuid4().hex[:6]}", "*/*:admin")
    with sign_in(store, token) as client:
        assert client.get("/console/tokens").status_code == 200
        store.context.tokens.revoke(store.context.tokens.verify(token).jti)
        answer = client.get("/console/tokens")
        assert answer.status_code == 303 and answer.headers["location"] == "/console/login"
        assert client.get("/console").status_code == 303


# -- headers ---------------------------------------------------------------------------------------------


def test_every_console_answer_carries_the_security_headers(store, console, registry):
    pub = registry.publications[0]
    with httpx.Client(base_url=store.base_url, follow_redirects=False) as anonymous:
        answers = [
            anonymous.get("/console/login"),
            anonymous.get("/console"),
            anonymous.post("/console/login", data={"token": store.mint("console-nobody", "acme/x:read")}),
            anonymous.post("/console/login", data={"token": "garbage"}),
            anonymous.get("/console/static/console.css"),
            anonymous.get("/console/static/console.js"),
            anonymous.get("/console/static/nothing.css"),
            anonymous.get("/console/nowhere"),
        ]
    answers += [console.get(path) for path in PAGES]
    answers += [
        console.get(_record_path(registry.repo, pub.key)),
        console.get("/console/records?health=bogus"),
        console.get(_record_path(registry.repo, "ck1-" + "0" * 56)),
    ]
    assert {a.status_code for a in answers} >= {200, 303, 400, 401, 403, 404}
    assert answers[6].status_code == 404 and h1(answers[6].text) == "Not found"  # a page, as every refusal
    for answer in answers:
        _assert_secure_headers(answer)
    # Outside the console the API keeps its own headers.
    with store.client() as client:
        assert "content-security-policy" not in client.get("/v1/health/live").headers


def test_no_page_holds_inline_script_or_style(store, console, registry):
    pub = registry.publications[0]
    for path in (*PAGES, _record_path(registry.repo, pub.key), "/console/login"):
        html = console.get(path).text
        assert "<style" not in html and " style=" not in html, path
        assert re.findall(r"<script[^>]*>", html) == ['<script src="/console/static/console.js" defer>'], path
        assert " on" not in re.sub(r'"[^"]*"', '""', " ".join(re.findall(r"<[a-z][^>]*>", html))), path
        assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in html


# -- pages with data ------------------------------------------------------------------------------------


def test_the_overview_counts_and_links(store, console, registry):
    page = console.get("/console")
    assert page.status_code == 200 and h1(page.text) == "Overview"
    assert f'href="/console/records?family={registry.family}"' in page.text
    assert 'href="/console/records?sm=' in page.text and 'href="/console/records?lane=' in page.text
    for heading in ("Live records", "Bytes", "Publishes", "Unhealthy records", "Recent denials"):
        assert f"<h2>{heading}</h2>" in page.text
    published = re.findall(r'<th>last (24 h|7 d)</th>\s*<td class="num"><a href="[^"]*outcome=ok">(\d+)</a>', page.text)
    assert [window for window, _ in published] == ["24 h", "7 d"]
    assert 4 <= int(published[0][1]) <= int(published[1][1])  # this module's four publishes at least


def test_unhealthy_records_are_counted_and_linked(store, console, registry):
    pub = registry.publish_another(store, own_component=True)
    with store.context.db.session() as session:  # what the scrub does when a component's bytes are gone
        assert set_blob_health(session, pub.components["consts"].digest, BLOB_MISSING, actor="test") == 1
    try:
        overview = console.get("/console").text
        section = overview.split("<h2>Unhealthy records</h2>")[1].split("<h2>")[0]
        assert re.search(r'<a href="/console/records\?health=blob_missing">\d+ blob_missing</a>', section)
        assert pub.key in section
        listed = console.get("/console/records", params={"health": "blob_missing", "family": f"{registry.family}-more"})
        assert pub.key in listed.text and 'class="health bad">blob_missing<' in listed.text
        record = console.get(_record_path(registry.repo, pub.key)).text
        assert "blob.damaged" in record  # the health change, in the record's history
    finally:
        with store.context.db.session() as session:
            set_blob_health(session, pub.components["consts"].digest, BLOB_OK, actor="test")


def test_the_records_page_lists_filters_and_badges_private_records(store, console, registry):
    page = console.get("/console/records", params={"family": registry.family})
    assert page.status_code == 200 and h1(page.text) == "Records"
    assert '<form method="get" class="filters"' in page.text and ">Filter</button>" in page.text
    for name in ("family", "sm", "lane", "repo", "publisher", "health"):
        assert f'name="{name}"' in page.text
    table = page.text.split('<table class="records">')[1].split("</table>")[0]
    keys = [pub.key for pub in registry.publications] + [registry.private.key]
    assert all(key in table for key in keys)
    assert table.count("<tr>") - 1 == 4  # header + four records of this family
    private_row = next(row for row in table.split("<tr>") if registry.private.key in row)
    assert ">private</span>" in private_row
    assert table.count(">private</span>") == 1
    assert f'href="{_record_path(registry.repo, registry.publications[0].key)}"' in table


@pytest.mark.parametrize("field", ["repo", "publisher", "health", "lane"])
def test_record_filters_narrow(store, console, registry, field):
    value = {"repo": registry.repo, "publisher": registry.publisher, "health": "ok", "lane": "baseline+packed"}[field]
    page = console.get("/console/records", params={"family": registry.family, field: value})
    table = page.text.split('<table class="records">')[1].split("</table>")[0]
    expected = {"repo": 3, "publisher": 2, "health": 4, "lane": 4}[field]
    assert table.count("<tr>") - 1 == expected, field
    assert f'name="{field}" value="{value}"' in page.text  # the form shows what was asked
    nothing = console.get(
        "/console/records",
        params={
            "family": registry.family,
            field: "acme/none" if field == "repo" else "blob_missing" if field == "health" else "nobody",
        },
    )
    assert "no matching live records" in nothing.text


def test_records_page_by_keyset(store, console, registry):
    first = console.get("/console/records", params={"family": registry.family, "limit": 3})
    following = next_link(first.text)
    assert following is not None and "cursor=" in following and f"family={registry.family}" in following
    second = console.get(following)
    assert second.status_code == 200 and next_link(second.text) is None
    seen = [
        key
        for key in [p.key for p in registry.publications] + [registry.private.key]
        if key in first.text or key in second.text
    ]
    assert len(seen) == 4
    assert not any(key in first.text and key in second.text for key in seen)


def test_the_record_page(store, console, registry):
    pub = registry.publications[0]
    page = console.get(_record_path(registry.repo, pub.key))
    assert page.status_code == 200 and h1(page.text) == "Record"
    for heading in (
        "Manifest",
        "Input contract",
        "Binding table",
        "Components",
        "Kernel lane",
        "Evidence",
        "Receipt",
        "History",
    ):
        assert f"<h2>{heading}</h2>" in page.text, heading
    assert '<table class="binding">' in page.text and 'id="binding-search"' in page.text
    assert "consts" in page.text and pub.components["consts"].digest in page.text
    assert "verifies against the current JWKS" in page.text
    assert "compiled_graph.publish" in page.text  # the history, from the audit log
    assert "0.228" in page.text and "19.4" in page.text  # the evidence
    missing = console.get(_record_path(registry.repo, "ck1-" + "0" * 56))
    assert missing.status_code == 404 and h1(missing.text) == "Not found"
    private = console.get(_record_path(registry.private_repo, registry.private.key))
    assert private.status_code == 200 and ">private</span>" in private.text


def test_a_receipt_that_does_not_verify_is_said_so(store, console, registry):
    pub = registry.publish_another(store)
    with store.context.db.session() as session:
        from sqlalchemy import update

        from cgstore.compiled_graphs.models import CompiledGraph

        session.execute(
            update(CompiledGraph).where(CompiledGraph.key == pub.key).values(receipt=CompiledGraph.receipt + "x")
        )  # the signature no longer matches
    page = console.get(_record_path(registry.repo, pub.key))
    assert "does not verify" in page.text and "verifies against" not in page.text


def test_the_tokens_page_never_shows_a_token(store, console, admin, registry):
    page = console.get("/console/tokens", params={"sub": registry.publisher})
    assert page.status_code == 200 and h1(page.text) == "Tokens"
    assert '<table class="tokens">' in page.text and '<table class="keys">' in page.text
    assert registry.publisher in page.text and "active" in page.text
    assert admin not in page.text and admin.split(".")[2] not in page.text
    child = store.context.tokens.attenuate(store.context.tokens.verify(admin), ["*/*:admin"], 600)
    chained = console.get("/console/tokens", params={"sub": child.claims.sub})
    row = next(r for r in chained.text.split("<tr") if child.jti in r)
    assert store.context.tokens.verify(admin).jti in row  # the parent chain
    assert child.token not in chained.text


def test_the_tokens_page_pages(store, console):
    sub = f"console-many-{uuid.uuid4().hex[:6]}"
    for _ in range(3):
        store.mint(sub, "acme/x:read")
    first = console.get("/console/tokens", params={"sub": sub, "limit": 2})
    second = console.get(next_link(first.text))
    assert second.status_code == 200 and next_link(second.text) is None
    assert second.text.count('<tr class="active">') == 1


def test_the_storage_page(store, console, registry):
    page = console.get("/console/storage")
    assert page.status_code == 200 and h1(page.text) == "Storage"
    assert '<svg class="growth"' in page.text
    chart = page.text.split('<svg class="growth"')[1].split("</svg>")[0]
    assert chart.count("<rect") == 30  # one column a day, the last 30 days, the newest with this test's blobs
    stored = sum(int(size) for size in re.findall(r"<title>\d{4}-\d\d-\d\d: (\d+) bytes</title>", chart))
    assert stored >= registry.publications[0].artifact.size  # one artifact, stored once (dedup)
    assert "Background tasks" in page.text and "audit-checkpoint" in page.text or "no background task" in page.text


# -- the audit page ----------------------------------------------------------------------------------------


def test_the_audit_page_filters_and_pages_newest_first(store, console, registry):
    page = console.get("/console/audit", params={"actor": registry.publisher, "action": "compiled_graph.*"})
    assert page.status_code == 200 and h1(page.text) == "Audit log"
    for name in ("actor", "jti", "repo", "action", "outcome", "source", "since", "until"):
        assert f'name="{name}"' in page.text
    table = page.text.split('<table class="audit">')[1].split("</table>")[0]
    ids = [int(i) for i in re.findall(r"<tr class=\"ok\">\s*<td>(\d+)</td>", table)]
    assert len(ids) == 2 and ids == sorted(ids, reverse=True)
    assert table.count("compiled_graph.publish") == 2
    first = console.get("/console/audit", params={"repo": registry.repo, "limit": 2})
    assert next_link(first.text) is not None
    second = console.get(next_link(first.text))
    first_ids = re.findall(r"<tr class=\"\w+\">\s*<td>(\d+)</td>", first.text)
    second_ids = re.findall(r"<tr class=\"\w+\">\s*<td>(\d+)</td>", second.text)
    assert first_ids and second_ids and int(first_ids[-1]) > int(second_ids[0])


def test_the_audit_page_filtered_by_repo_lists_its_publishes_and_yanks(store, console, registry, admin):
    """Publishes and yanks concern their repo like its uploads do: ``repo=`` finds them (it once found neither)."""
    target = registry.publish_another(store)
    with store.client(admin) as client:
        owner, name = registry.repo.split("/")
        assert (
            client.post(
                f"/v1/repos/{owner}/{name}/compiled-graphs/{target.key}:yank", json={"reason": "superseded"}
            ).status_code
            == 200
        )
    page = console.get("/console/audit", params={"repo": registry.repo, "action": "compiled_graph.*"})
    table = page.text.split('<table class="audit">')[1].split("</table>")[0]
    assert table.count("<td>compiled_graph.publish</td>") >= 4 and table.count("<td>compiled_graph.yank</td>") == 1
    assert f"{registry.repo}:{target.key}" in table


def test_the_audit_page_shows_aggregated_401s_with_their_count(store, console):
    source_path = f"/v1/audit?probe={uuid.uuid4().hex}"
    with store.client("bad-token") as client:
        for _ in range(3):
            assert client.get(source_path).status_code == 401
    store.context.denials.flush()
    page = console.get("/console/audit", params={"action": "auth", "outcome": "TOKEN_INVALID"})
    assert re.search(r'class="aggregate"[^>]*>×\d+<', page.text)


# -- why a declaration misses ----------------------------------------------------------------------------


def _declaration(pub, **changed) -> dict[str, str]:
    """The explain form filled with ``pub``'s declaration (its manifest's axes), ``changed`` replacing fields."""
    axes = pub.manifest["axes"]
    typed = {
        "family": pub.manifest["family"],
        "sm": axes["sm"],
        "envelope": json.dumps(axes["envelope"]),
        "toolchain": json.dumps(axes["toolchain"]),
    }
    return {**typed, **changed}


def test_explain_names_the_axis_a_near_record_differs_on_for_the_admins_token(store, console, registry):
    """The answer is discover's for the signed-in token: an admin whose token reads the repo is told the
    nearest record and the differing axis with both values; one whose token does not (``*/*`` names no repo)
    is told the family has nothing it may read; the record's own declaration is a hit."""
    pub = registry.publications[0]
    near = {**pub.manifest["axes"]["envelope"], "guidance": ["0.5"]}
    reader = store.mint(f"console-admin-{uuid.uuid4().hex[:8]}", "*/*:admin", f"{registry.repo}:read")
    with sign_in(store, reader) as client:
        page = client.get("/console/explain", params=_declaration(pub, envelope=json.dumps(near)))
        flat = {**pub.manifest["axes"]["toolchain"]["components"], **pub.manifest["axes"]["toolchain"]["recorded"]}
        hit = client.get("/console/explain", params=_declaration(pub, toolchain=json.dumps(flat)))
    assert page.status_code == 200 and h1(page.text) == "Explain a miss"
    text = html.unescape(page.text)
    assert f"miss: 3 records of {registry.family} in {registry.repo}; nearest differs in envelope guidance: " in text
    assert re.search(r"envelope guidance: \[0\.5\] here, \[[-0-9.]+\] recorded", text)
    nearest = re.findall(r'href="/console/records/acme/[^/"]+/(ck1-[0-9a-f]{56})"', page.text)
    assert len(nearest) == 1 and nearest[0] in {p.key for p in registry.publications}
    assert hit.status_code == 200 and "<h2>Hit</h2>" in hit.text and pub.key in hit.text  # a flat toolchain too
    unnamed = console.get("/console/explain", params=_declaration(pub))  # the ``*/*:admin`` token
    assert unnamed.status_code == 200
    assert f"miss: no record of family '{registry.family}' this token may read" in html.unescape(unnamed.text)


def test_explain_renders_hostile_input_as_text(store, console, registry):
    """Each hostile field is refused by the declaration's checks, whose messages quote it: shown as text."""
    pub = registry.publications[0]
    asked = [
        _declaration(pub, family=HOSTILE),
        _declaration(pub, release=HOSTILE),
        _declaration(pub, sm=HOSTILE),
        _declaration(pub, envelope=json.dumps({HOSTILE_FIELDS["layout"]: 1})),
        _declaration(pub, toolchain=json.dumps({HOSTILE_FIELDS["mint phases"]: HOSTILE})),
    ]
    pages = [console.get("/console/explain", params=params) for params in asked]
    for page in pages:
        assert page.status_code == 400 and h1(page.text) == "Explain a miss", page.text
        assert "<script>alert" not in page.text and "<img src=x" not in page.text
    assert 'value="&lt;script&gt;alert(1)&lt;/script&gt;&#34;&#39;&amp;"' in pages[1].text  # the form's value
    assert "got &#39;&lt;script&gt;alert(1)&lt;/script&gt;" in pages[2].text  # the sm, quoted in the refusal
    assert "&lt;script&gt;alert(&#39;layout&#39;)&lt;/script&gt;" in pages[3].text  # the envelope's field


@pytest.mark.parametrize(
    "changed, said",
    [
        ({"envelope": "{not json"}, "envelope is not JSON (Expecting property name enclosed in double quotes"),
        ({"envelope": "[1, 2]"}, "envelope must be a JSON object, not list"),
        ({"toolchain": "{"}, "toolchain is not JSON"),
        ({"envelope": '{"shapes": "big"}'}, "envelope: "),
        ({"sm": ""}, "a declaration needs sm"),
    ],
)
def test_explain_with_a_bad_declaration_says_so_on_the_page(store, console, registry, changed, said):
    answer = console.get("/console/explain", params=_declaration(registry.publications[0], **changed))
    assert answer.status_code == 400 and h1(answer.text) == "Explain a miss"
    error = re.findall(r'<p class="error" role="alert">(.*?)</p>', answer.text, re.S)
    assert len(error) == 1 and html.unescape(error[0]).startswith(said), error
    assert '<form method="get" class="filters explain">' in answer.text


# -- escaping, bad input, the audit of reads --------------------------------------------------------------


def test_hostile_strings_render_as_text(store, console, registry, admin):
    registry.yank_another_with_a_hostile_reason(store, admin)
    pages = [
        console.get("/console/records", params={"family": registry.family}),
        console.get("/console/records", params={"publisher": HOSTILE, "repo": registry.repo}),
        console.get(_record_path(registry.private_repo, registry.private.key)),
        console.get(
            "/console/audit", params={"action": "compiled_graph.yank", "actor": store.context.tokens.verify(admin).sub}
        ),
        console.get("/console/audit", params={"actor": HOSTILE}),
        console.get("/console/tokens", params={"sub": HOSTILE}),
    ]
    for page in pages:
        assert page.status_code == 200
        assert "<script>alert" not in page.text and "<img src=x" not in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&#34;&#39;&amp;" in pages[1].text  # the publisher, as text
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in pages[3].text
    assert "r\\u043eot" in pages[3].text  # the escaped form the audit stores, shown as stored
    assert 'value="&lt;script&gt;alert(1)&lt;/script&gt;&#34;&#39;&amp;"' in pages[4].text  # the form's value


def test_every_free_form_field_of_the_record_page_renders_as_text(store, console, registry):
    """Evidence, kernel-lane evidence, the layout's display and each publisher of one key in a private cache
    ("Published by ..."): each marker shown as text, none as markup (the template-wide property is
    test_escaping.py's)."""
    pub = registry.publish_hostile_in_the_private_cache(store)
    page = console.get(_record_path(registry.private_repo, pub.key))
    assert page.status_code == 200 and page.text.count("<h2>Published by ") == 2
    assert "<script>alert" not in page.text and "<img src=x" not in page.text
    for field, marker in HOSTILE_FIELDS.items():
        assert str(escape(marker)) in page.text, field
    for publisher in (HOSTILE, HOSTILE_FIELDS["second publisher"]):
        assert f"<h2>Published by {escape(publisher)}" in page.text


@pytest.mark.parametrize(
    "path, params",
    [
        ("/console/records", {"health": "bogus"}),
        ("/console/records", {"repo": "not a repo"}),
        ("/console/records", {"cursor": "made-up"}),
        ("/console/records", {"limit": "0"}),
        ("/console/audit", {"since": "yesterday"}),
        ("/console/audit", {"cursor": "-1"}),
        ("/console/audit", {"limit": "100000"}),
        ("/console/records", {"limit": "\u0967"}),  # DEVANAGARI DIGIT ONE: int() reads it as 1
        ("/console/tokens", {"cursor": "nosuchjti"}),
        ("/console/records", {"family": "x" * 2000}),
    ],
)
def test_bad_filter_input_shows_the_page_with_an_error(store, console, path, params):
    answer = console.get(path, params=params)
    assert answer.status_code == 400, answer.text
    assert 'class="error"' in answer.text and h1(answer.text) in ("Records", "Audit log", "Tokens")
    assert '<form method="get" class="filters"' in answer.text


def test_a_query_no_database_stores_gets_a_page_too(console):
    answer = console.get("/console/records", params={"family": "a\x00b"})  # refused by the app-wide input rule
    assert answer.status_code == 400 and h1(answer.text) == "Bad request"
    assert 'class="message"' in answer.text and "NUL" in answer.text
    _assert_secure_headers(answer)


def test_console_reads_are_audited(store, console, admin, registry):
    jti = store.context.tokens.verify(admin).jti
    console.get("/console/records", params={"family": registry.family})
    console.get(_record_path(registry.repo, registry.publications[0].key))
    console.get("/console/audit", params={"actor": "nobody"})
    reads = rows(store, AuditEvent.jti == jti)
    assert [e.action for e in reads] == [
        "POST /console/login",
        "GET /console/records",
        "GET /console/records/{owner}/{repo}/{key}",
        "GET /console/audit",
    ]
    assert reads[1].target == f"/console/records?family={registry.family}" and reads[1].outcome == "ok"
    assert reads[2].target == _record_path(registry.repo, registry.publications[0].key)


def test_the_fit_chart_draws_each_lane_against_card_sizes():
    gib = 1 << 30
    lane = '<b>"dense"</b>'
    svg = charts.fit_chart(
        {"winner": "baseline+packed", "fit": {"peaks": {"baseline+packed": 20 * gib, lane: 60 * gib}, "order": []}}
    )
    assert svg.startswith('<svg class="fit"') and svg.count("<rect") == 4
    assert "&lt;b&gt;&#34;dense&#34;&lt;/b&gt;" in svg and "<b>" not in svg
    assert "80 GiB" in svg and "24 GiB" in svg and 'class="bar winner"' in svg
    assert charts.fit_chart({"winner": "x", "fit": None}) is None and charts.fit_chart(None) is None


def test_quoting_in_links(console, registry):
    page = console.get("/console")
    assert f'href="/console/records?family={quote(registry.family)}"' in page.text


def _blobs_figure(html: str) -> int:
    """The storage page's count of blobs."""
    return int(re.search(r'<tbody><tr>\s*<td class="num">(\d+)</td>', html).group(1))


def _figures_time(html: str) -> str:
    """When the page's whole-registry figures were computed (ISO 8601, to the microsecond)."""
    return re.search(r'Figures as of <time datetime="([^"]+)"', html).group(1)


def test_stale_figures_are_answered_while_recomputed(make_store):
    """Past ``CGSTORE_CONSOLE_AGGREGATES_S`` a view is answered at once with the previous figures and their
    time while they are recomputed in the background; a later view shows the new ones, with a later time."""
    live = make_store("embedded", console_aggregates_s=1)
    admin = live.mint("console-admin", "*/*:admin")
    writer = live.mint("writer", "acme/cache:read,write")
    with sign_in(live, admin) as console:
        first = console.get("/console/storage").text
        with live.client(writer) as client:
            data = uuid.uuid4().bytes * 100
            digest = "blake3:" + blake3.blake3(data).hexdigest()
            assert client.put(f"/v1/repos/acme/cache/blobs/{digest}", content=data).status_code == 201
        time.sleep(1.2)  # the figures are now older than their interval
        stale = console.get("/console/storage").text
        assert (_blobs_figure(stale), _figures_time(stale)) == (_blobs_figure(first), _figures_time(first))
        deadline = time.monotonic() + 30
        while _blobs_figure(fresh := console.get("/console/storage").text) == _blobs_figure(first):
            assert time.monotonic() < deadline, "the figures were never recomputed"
            time.sleep(0.05)
        assert _blobs_figure(fresh) == _blobs_figure(first) + 1
        assert _figures_time(fresh) > _figures_time(first)


def test_figures_belong_to_their_store_context_and_go_with_it():
    """A context made after another is gone (CPython often gives it the freed one's ``id()``) computes
    its own figures, and no figures outlive their context."""

    class Context:
        def __init__(self, n: int) -> None:
            self.n, self.settings = n, SimpleNamespace(console_aggregates_s=3600)

    aggregates = Aggregates(lambda ctx: ctx.n)
    for n in range(20):
        context = Context(n)
        assert aggregates.get(context) == aggregates.get(context) == n
        del context
    assert len(aggregates._cached) == 0


def test_whole_registry_figures_are_reused_for_their_interval(make_store):
    """``CGSTORE_CONSOLE_AGGREGATES_S``: the storage and overview sums are computed once per interval, with
    their time; what is read per page (the records list) stays live."""
    live = make_store("embedded", console_aggregates_s=3600)
    admin = live.mint("console-admin", "*/*:admin")
    writer = live.mint("writer", "acme/cache:read,write")

    with sign_in(live, admin) as console:
        first = console.get("/console/storage").text
        overview = console.get("/console").text
        assert "Figures as of" in first and "computed at most every 3600 s" in first
        with live.client(writer) as client:
            data = uuid.uuid4().bytes * 100
            digest = "blake3:" + blake3.blake3(data).hexdigest()
            assert client.put(f"/v1/repos/acme/cache/blobs/{digest}", content=data).status_code == 201
        again = console.get("/console/storage").text
        assert _blobs_figure(again) == _blobs_figure(first)
        assert re.findall(r"Figures as of (.*?) UTC", again) == re.findall(r"Figures as of (.*?) UTC", first)
        assert console.get("/console").text.split("Figures as of")[1][:40] == overview.split("Figures as of")[1][:40]
