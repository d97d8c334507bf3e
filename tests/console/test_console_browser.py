"""The admin console in a real browser (Debian's chromium driven by Playwright), both configurations.

Every step goes through the UI as a person would: the sign-in form, the navigation links, the GET filter
forms, the ``rel="next"`` link. Each test's tab records every request, console error, page error and dialog;
none may leave the store's origin, log an error (a CSP violation is one) or open a dialog. A screenshot of
every page lands in ``.test-results/console/<page>-<configuration>.png``. The HTTP side of the same promises
is test_console_http.py.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlencode, urlparse

import pytest
from playwright.sync_api import Browser, BrowserContext, ConsoleMessage, Locator, Page, Response
from sqlalchemy import update

from cgstore.compiled_graphs.models import CompiledGraph
from cgstore.console.router import COOKIE
from cgstore_client.metadata import QUANTUM_BYTES, RULE_FIT_CONSTRAINED_SPEED
from tests.console.conftest import HOSTILE, HOSTILE_FIELDS, HOSTILE_REASON, SCREENSHOTS

pytestmark = pytest.mark.browser

#: Longest a single browser step may wait (the suite stays bounded when a page never comes).
STEP_MS = 20_000


@dataclass
class Tab:
    """One browser context and its page, and what happened in it."""

    store: object
    context: BrowserContext
    page: Page
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    @property
    def path(self) -> str:
        return urlparse(self.page.url).path

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlparse(self.page.url).query)

    def go(self, path: str) -> None:
        self.page.goto(self.store.base_url + path)

    def submit(self, button: Locator) -> int:
        """Click a button that sends a form; the status of the page it leads to."""
        with self.page.expect_navigation() as navigation:
            button.click()
        return navigation.value.status

    def sign_in(self, token: str) -> int:
        self.go("/console/login")
        self.page.locator('input[name="token"]').fill(token)
        return self.submit(self.page.get_by_role("button", name="Sign in"))

    def nav(self, label: str) -> None:
        with self.page.expect_navigation():
            self.page.locator("header.top nav").get_by_role("link", name=label, exact=True).click()

    def filter(self, **fields: str) -> int:
        form = self.page.locator("form.filters")
        for name, value in fields.items():
            form.locator(f'input[name="{name}"]').fill(value)
        return self.submit(form.get_by_role("button", name="Filter"))

    def next_page(self) -> bool:
        """Follow ``rel="next"`` when the page has one."""
        link = self.page.locator('a[rel="next"]')
        if link.count() == 0:
            return False
        with self.page.expect_navigation():
            link.click()
        return True

    def heading(self) -> str:
        return self.page.locator("h1").inner_text()

    def column(self, table: str, index: int) -> list[str]:
        """The text of one column (0-based) of a table's body rows."""
        return self.page.locator(f"table.{table} > tbody > tr > td:nth-child({index + 1})").all_inner_texts()

    def shot(self, name: str) -> None:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}-{self.store.configuration}.png"), full_page=True)

    def assert_clean(self) -> None:
        origin = urlparse(self.store.base_url).netloc
        # The pages' favicon is the empty data: URL, so not even /favicon.ico is asked for.
        foreign = [url for url in self.requests if urlparse(url).netloc != origin]
        assert not foreign, f"requests left the store's origin: {foreign}"
        assert not self.errors, self.errors
        assert not self.dialogs, self.dialogs


@contextlib.contextmanager
def opened(store, browser: Browser, **options) -> Iterator[Tab]:
    """A fresh context (no cookies) with one page, its requests, errors and dialogs recorded."""
    context = browser.new_context(viewport={"width": 1280, "height": 860}, **options)
    context.set_default_timeout(STEP_MS)
    page = context.new_page()
    tab = Tab(store, context, page)
    page.on("request", lambda request: tab.requests.append(request.url))
    page.on("console", lambda message: _is_error(message) and tab.errors.append(message.text))
    page.on(
        "response",
        lambda response: _failed_resource(response) and tab.errors.append(f"{response.status} {response.url}"),
    )
    page.on("pageerror", lambda error: tab.errors.append(str(error)))
    page.on("dialog", lambda dialog: (tab.dialogs.append(dialog.message), dialog.dismiss()))
    try:
        yield tab
    finally:
        context.close()
    tab.assert_clean()


def _is_error(message: ConsoleMessage) -> bool:
    """An error the page logged (a CSP violation is one). Chromium also logs every answer >= 400 as "Failed to
    load resource": the 401/403 pages are meant, and a failed stylesheet or script is caught by its response."""
    return message.type == "error" and not message.text.startswith("Failed to load resource:")


def _failed_resource(response: Response) -> bool:
    """A stylesheet, script or image the page asked for and did not get (documents are judged by the tests)."""
    return response.request.resource_type != "document" and response.status >= 400


@pytest.fixture
def tab(store, browser) -> Iterator[Tab]:
    with opened(store, browser) as opened_tab:
        yield opened_tab


def _keys(tab: Tab) -> list[str]:
    return tab.column("records", 1)


def _audit_ids(tab: Tab) -> list[int]:
    """The entry ids of an audit table (an empty page has one unclassed row, "no entries")."""
    return [int(i) for i in tab.page.locator("table.audit > tbody > tr[class] > td:nth-child(1)").all_inner_texts()]


# -- signing in and out ---------------------------------------------------------------------------


def test_sign_in_shows_the_overview_and_sign_out_ends_the_session(tab, admin, registry):
    tab.go("/console")
    assert tab.path == "/console/login" and tab.heading() == "Admin console"
    assert tab.page.get_by_role("button", name="Sign out").count() == 0
    assert tab.sign_in(admin) == 200
    assert tab.path == "/console" and tab.heading() == "Overview"
    for heading in ("Live records", "Bytes", "Publishes", "Unhealthy records", "Recent denials"):
        assert tab.page.get_by_role("heading", name=heading, exact=True).is_visible(), heading
    cards = tab.page.locator(".cards .card")
    assert cards.count() == 5 and cards.first.is_visible()
    assert int(cards.first.locator(".figure").inner_text()) >= 4  # this module's records at least
    assert tab.page.locator("table.counts.family").get_by_role("link", name=registry.family).is_visible()

    (cookie,) = tab.context.cookies()
    assert cookie["name"] == COOKIE and cookie["value"] == admin
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    assert not cookie["secure"]  # plain http here
    assert time.time() < cookie["expires"] <= time.time() + 3600 + 5  # expires with the token
    assert tab.page.evaluate("document.cookie") == ""  # HttpOnly: no script reads it

    assert tab.submit(tab.page.get_by_role("button", name="Sign out")) == 200
    assert tab.path == "/console/login" and tab.heading() == "Admin console"
    assert tab.context.cookies() == []
    tab.go("/console")
    assert tab.path == "/console/login"


def test_a_token_without_admin_gets_the_403_page_and_no_cookie(tab, store):
    reader = store.mint(f"console-reader-{uuid.uuid4().hex[:6]}", "acme/*:read,write", "*/*:read")
    assert tab.sign_in(reader) == 403
    assert tab.heading() == "Forbidden" and "admin" in tab.page.locator("p.message").inner_text()
    assert tab.page.get_by_role("button", name="Sign out").count() == 0
    assert tab.page.locator("header.top").count() == 0  # no navigation
    assert tab.context.cookies() == []
    tab.go("/console/records")
    assert tab.path == "/console/login"


def test_an_expired_token_gets_the_sign_in_again_with_the_reason(tab, store, admin, monkeypatch):
    assert tab.sign_in(admin) == 200 and tab.heading() == "Overview"
    monkeypatch.setattr(store.context.tokens, "_clock", lambda: time.time() + 2 * 3600)  # past the token's hour
    tab.nav("Records")  # signed out at the next page
    assert tab.path == "/console/login" and tab.context.cookies() == []
    assert tab.sign_in(admin) == 401
    assert tab.path == "/console/login" and tab.heading() == "Admin console"
    assert "expired" in tab.page.get_by_role("alert").inner_text()
    assert tab.context.cookies() == []


# -- the pages --------------------------------------------------------------------------------------


def test_records_filter_through_the_form_and_page_with_next(tab, admin, registry):
    tab.sign_in(admin)
    tab.nav("Records")
    assert tab.heading() == "Records"
    assert tab.filter(family=registry.family) == 200
    assert tab.query["family"] == [registry.family]
    assert set(tab.column("records", 2)) == {registry.family}
    expected = sorted([pub.key for pub in registry.publications] + [registry.private.key])
    assert sorted(_keys(tab)) == expected
    assert tab.page.locator("table.records .badge.private").count() == 1

    tab.go(f"{tab.path}?{urlencode({'family': registry.family, 'limit': 1})}")
    seen = _keys(tab)
    while tab.next_page():
        assert tab.query["family"] == [registry.family] and "cursor" in tab.query
        seen += _keys(tab)
    assert sorted(seen) == expected  # every record exactly once


def _with_a_gpu_verdict(store, key: str) -> None:
    """Give a record the kernel-lane verdict a GPU mint writes into the archive's metadata (the session's
    archives are minted on CPU, which records none), as its row keeps it."""
    quantum = QUANTUM_BYTES
    verdict = {
        "winner": "baseline+packed",
        "rule": RULE_FIT_CONSTRAINED_SPEED,
        "binding": "vram-tiebreak",
        "margin_fraction": 0.05,
        "candidates": ["baseline+packed", "baseline+dense"],
        "fit": {
            "quantum_bytes": quantum,
            "activation_spike_fraction": 0.2,
            "fragmentation_headroom_bytes": 1 << 30,
            "peaks": {"baseline+packed": 53 * quantum, "baseline+dense": 92 * quantum},
            "order": ["baseline+packed", "baseline+dense"],
        },
    }
    with store.context.db.session() as session:
        session.execute(update(CompiledGraph).where(CompiledGraph.key == key).values(kernel_lane=verdict))


def test_the_record_page(tab, store, admin, registry):
    pub = registry.publish_another(store)
    _with_a_gpu_verdict(store, pub.key)
    tab.sign_in(admin)
    tab.nav("Records")
    tab.filter(family=f"{registry.family}-more")
    with tab.page.expect_navigation():
        tab.page.get_by_role("link", name=pub.key, exact=True).click()
    assert tab.path == f"/console/records/{registry.repo}/{pub.key}" and tab.heading() == "Record"
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
        assert tab.page.get_by_role("heading", name=heading, exact=True).is_visible(), heading
    facts = tab.page.locator("dl.facts").first.inner_text()
    assert pub.key in facts and f"{registry.family}-more" in facts and HOSTILE in facts

    rows = tab.page.locator("table.binding > tbody > tr")
    names = tab.column("binding", 0)
    assert len(names) >= 2 and rows.count() == len(names)
    search = tab.page.locator("#binding-search")
    assert search.is_visible()  # shown by the script: the CSP lets the console's own script run
    search.fill(names[0])
    shown = [rows.nth(i).is_visible() for i in range(rows.count())]
    assert shown[0] and shown.count(True) == sum(1 for n in names if names[0].lower() in n.lower()) < len(names)
    search.fill("no-such-constant")
    assert not any(rows.nth(i).is_visible() for i in range(rows.count()))
    search.fill("")
    assert all(rows.nth(i).is_visible() for i in range(rows.count()))

    assert "consts" in tab.column("components", 0)
    assert pub.components["consts"].digest in tab.column("components", 1)
    fit = tab.page.locator("svg.fit")
    assert fit.is_visible() and fit.locator("rect.bar").count() == 2 and fit.locator("rect.winner").count() == 1
    assert "verifies against the current JWKS" in tab.page.locator(".verdict").inner_text()
    assert "compiled_graph.publish" in tab.column("audit", 4)  # the history


def test_the_audit_log_filters_through_the_form_and_pages_newest_first(tab, admin, registry):
    tab.sign_in(admin)
    tab.nav("Audit")
    assert tab.heading() == "Audit log"
    assert tab.filter(repo=registry.repo, action="compiled_graph.*") == 200
    assert tab.query["repo"] == [registry.repo] and tab.query["action"] == ["compiled_graph.*"]
    ids = _audit_ids(tab)
    assert len(ids) >= 3 and ids == sorted(ids, reverse=True)  # this module's publishes, newest first
    assert all(action.startswith("compiled_graph.") for action in tab.column("audit", 4))
    assert set(tab.column("audit", 6)) == {registry.repo}

    tab.go(f"{tab.path}?{urlencode({'repo': registry.repo, 'action': 'compiled_graph.*', 'limit': 2})}")
    paged = _audit_ids(tab)
    while tab.next_page():
        assert tab.query["repo"] == [registry.repo] and "cursor" in tab.query
        paged += _audit_ids(tab)
    assert paged == ids  # the same entries, newest first, none twice


def test_the_tokens_and_storage_pages(tab, admin, registry):
    tab.sign_in(admin)
    tab.nav("Tokens")
    assert tab.heading() == "Tokens" and tab.page.locator("table.keys > tbody > tr").count() >= 1
    tab.filter(sub=registry.publisher)
    assert tab.query["sub"] == [registry.publisher]
    assert set(tab.column("tokens", 1)) == {registry.publisher} and "active" in tab.column("tokens", 2)
    assert admin not in tab.page.content()
    tab.nav("Storage")
    assert tab.heading() == "Storage"
    growth = tab.page.locator("svg.growth")
    assert growth.is_visible() and growth.locator("rect").count() == 30
    assert int(tab.column("bytes", 0)[0]) >= 1  # blobs
    assert tab.page.locator("table.leases").is_visible()


# -- hostile strings, the whole walk, JavaScript off -----------------------------------------------------


def test_hostile_strings_render_as_text(tab, store, admin, registry):
    target = registry.yank_another_with_a_hostile_reason(store, admin)
    assert tab.sign_in(store.mint(HOSTILE, "*/*:admin")) == 200
    assert tab.page.locator("header.top .who").inner_text() == HOSTILE

    tab.nav("Records")
    tab.filter(publisher=HOSTILE, repo=registry.repo)  # typed into the form as any text
    assert tab.query["publisher"] == [HOSTILE]
    assert tab.page.locator('input[name="publisher"]').input_value() == HOSTILE
    assert set(tab.column("records", 7)) == {HOSTILE} and registry.publications[2].key in _keys(tab)
    _assert_nothing_injected(tab)

    tab.go(f"/console/records/{registry.private_repo}/{registry.private.key}")
    assert f"{HOSTILE} (" in tab.page.locator("dl.facts").first.inner_text()  # the publisher
    _assert_nothing_injected(tab)

    hostile = registry.publish_hostile_in_the_private_cache(store)  # every free-form field of a record page
    tab.go(f"/console/records/{registry.private_repo}/{hostile.key}")
    shown = tab.page.locator("article.record").all_inner_texts()
    assert len(shown) == 2  # one per publisher of the key
    for name, marker in HOSTILE_FIELDS.items():
        assert any(marker in text for text in shown), name
    assert tab.page.get_by_role("heading", name=f"Published by {HOSTILE}").count() == 1
    _assert_nothing_injected(tab)

    tab.nav("Audit")
    tab.filter(action="compiled_graph.yank", repo=registry.repo)
    assert tab.column("audit", 5) == [f"{registry.repo}:{target.key}"]
    tab.page.locator("table.audit details summary").first.click()
    detail = tab.page.locator("table.audit details pre").first.inner_text()
    # Shown exactly as the audit stores it: the markup as text, the non-ASCII letter escaped.
    assert HOSTILE_REASON.replace("\u043e", "\\u043e") in detail
    _assert_nothing_injected(tab)
    assert tab.dialogs == []


def _assert_nothing_injected(tab: Tab) -> None:
    assert tab.page.evaluate("document.scripts.length") == 1  # the console's own script, nothing else
    assert tab.page.locator("script:not([src]), img, iframe, [onerror]").count() == 0


def test_every_page_stays_on_the_store_and_is_screenshotted(store, browser, admin, registry):
    pub = registry.publications[0]
    with opened(store, browser) as tab:
        tab.go("/console/login")
        tab.shot("login")
        tab.sign_in(admin)
        tab.shot("overview")
        tab.nav("Records")
        tab.filter(repo=registry.repo)
        tab.shot("records")
        with tab.page.expect_navigation():
            tab.page.get_by_role("link", name=pub.key, exact=True).click()
        tab.shot("record")
        for page in ("Audit", "Tokens", "Storage"):
            tab.nav(page)
            tab.shot(page.lower())
        walked = list(tab.requests)
    with opened(store, browser) as refused:
        assert refused.sign_in(store.mint(f"console-reader-{uuid.uuid4().hex[:6]}", "*/*:read")) == 403
        refused.shot("forbidden")
    static = {urlparse(url).path for url in walked if "/static/" in url}
    assert static == {"/console/static/console.css", "/console/static/console.js"}
    for name in ("login", "overview", "records", "record", "audit", "tokens", "storage", "forbidden"):
        assert (SCREENSHOTS / f"{name}-{store.configuration}.png").stat().st_size > 10_000, name


def test_sign_in_and_filters_work_with_javascript_off(store, browser, admin, registry):
    with opened(store, browser, java_script_enabled=False) as tab:
        assert tab.sign_in(admin) == 200 and tab.heading() == "Overview"
        tab.nav("Records")
        tab.filter(family=registry.family)
        assert tab.query["family"] == [registry.family] and set(tab.column("records", 2)) == {registry.family}
        assert len(_keys(tab)) == 4
        with tab.page.expect_navigation():
            tab.page.get_by_role("link", name=registry.publications[0].key, exact=True).click()
        assert not tab.page.locator("#binding-search").is_visible()  # no script: no search box, the whole table
        rows = tab.page.locator("table.binding > tbody > tr")
        assert rows.count() >= 2 and all(rows.nth(i).is_visible() for i in range(rows.count()))
