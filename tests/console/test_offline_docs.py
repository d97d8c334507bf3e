"""/docs renders the API in a real browser (Debian's chromium) without any request leaving the store's origin."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest

from tests.console.conftest import SCREENSHOTS

pytestmark = pytest.mark.browser


def test_docs_render_offline(store, browser):
    origin = urlparse(store.base_url).netloc
    requested: list[str] = []
    page = browser.new_page()
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{store.base_url}/docs")
    # Swagger UI 5 renders OpenAPI 3.1; 4.x shows "Unable to render this definition" instead.
    page.get_by_text("/v1/compiled-graphs:resolve", exact=True).wait_for(timeout=30_000)
    assert page.locator(".opblock").count() > 20
    assert page.get_by_text("Unable to render this definition").count() == 0
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"docs-{store.configuration}.png"), full_page=False)
    page.close()
    foreign = [url for url in requested if urlparse(url).netloc != origin]
    assert not foreign, f"/docs requested other hosts: {foreign}"
    assert any(url.endswith("/openapi.json") for url in requested)


def test_redoc_is_not_served(store):
    with store.client() as http:
        assert http.get("/redoc").status_code == 404
        assert http.get("/docs").status_code == 200
