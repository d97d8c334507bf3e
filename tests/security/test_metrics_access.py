"""``GET /metrics`` is for the metrics token only, and names no family the operator did not allow.

Before, anyone could scrape it and read ``cgstore_resolve_answers_total{family=…}``: the
families other tenants resolve in their private caches. Both configurations.
"""

from __future__ import annotations

import re
import uuid

import httpx
import pytest

from tests.support.live_store import CONFIGURATIONS, unique_repo

ALLOWED_FAMILY = "shared-family"


def scrape(store, authorization: str | None) -> httpx.Response:
    headers = {"Authorization": authorization} if authorization is not None else {}
    return httpx.get(f"{store.base_url}/metrics", headers=headers, timeout=60)


def unknown_path(store) -> httpx.Response:
    return httpx.get(f"{store.base_url}/no-such-path", timeout=60)


def resolve_as_tenant(store, family: str) -> None:
    """A tenant resolves (a miss) under ``family`` in its own repo."""
    token = store.mint(f"tenant-{uuid.uuid4().hex[:8]}", f"acme/{unique_repo()}:read,write")
    with store.client(token) as client:
        response = client.post("/v1/compiled-graphs:resolve", json={"family": family, "keys": ["ck1-" + "0" * 56]})
    assert response.status_code == 200, response.text


def secret_family() -> str:
    return f"tenant-private-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer wrong-token", "Basic c2NyYXBlcjp4"],
    ids=["none", "empty", "scheme-only", "wrong", "basic"],
)
def test_without_the_metrics_token_metrics_is_an_unknown_path(store, authorization):
    response = scrape(store, authorization)
    assert response.status_code == 404
    assert response.json() == unknown_path(store).json()
    assert "cgstore_" not in response.text


def test_a_store_token_is_not_the_metrics_token(store):
    token = store.mint("admin-user", "*/*:read,write,admin")
    assert scrape(store, f"Bearer {token}").status_code == 404


def test_a_prefix_or_extension_of_the_metrics_token_is_refused(store):
    real = store.settings.metrics_token.get_secret_value()
    for guess in (real[:-1], real + "x", real.upper() if real.upper() != real else real.lower()):
        assert scrape(store, f"Bearer {guess}").status_code == 404


def test_the_metrics_token_gets_the_prometheus_text(store):
    response = scrape(store, store.metrics_headers()["Authorization"])
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "cgstore_requests_total" in response.text


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_unset_metrics_token_closes_metrics_to_everyone(make_store, configuration):
    live = make_store(configuration, metrics_token=None)
    for authorization in (None, "Bearer", "Bearer None"):
        assert scrape(live, authorization).status_code == 404


def test_a_tenants_family_is_not_a_label_by_default(store):
    family = secret_family()
    resolve_as_tenant(store, family)
    text = store.scrape_metrics()
    assert family not in text
    assert 'cgstore_resolve_answers_total{family="other",status="miss"}' in text


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_only_allow_listed_families_are_labels(make_store, configuration):
    live = make_store(configuration, metrics_families=f" {ALLOWED_FAMILY} , another-family,")
    family = secret_family()
    resolve_as_tenant(live, ALLOWED_FAMILY)
    resolve_as_tenant(live, family)
    text = live.scrape_metrics()
    assert f'cgstore_resolve_answers_total{{family="{ALLOWED_FAMILY}",status="miss"}} 1.0' in text
    assert 'cgstore_resolve_answers_total{family="other",status="miss"} 1.0' in text
    assert family not in text


def _denials(text: str, code: str) -> float:
    line = re.search(rf'^cgstore_denials_total{{code="{code}"}} (\S+)$', text, re.MULTILINE)
    return float(line.group(1)) if line else 0.0


def test_refusals_are_counted_by_code_and_hidden_misses_are_not(store):
    """401s and 403s move ``cgstore_denials_total{code}``; a 404, hidden or not, moves nothing there."""
    before = store.scrape_metrics()
    repo = unique_repo("denied")
    with store.client("not-a-token") as client:
        assert client.get(f"/v1/repos/acme/{repo}/compiled-graphs").status_code == 401
    with store.client(store.mint("mallory", f"acme/{repo}:read")) as client:
        assert client.put(f"/v1/repos/root/{repo}/blobs/blake3:{'0' * 64}", content=b"x").status_code == 403
        assert client.get(f"/v1/repos/other/{repo}/compiled-graphs").status_code == 404
    after = store.scrape_metrics()
    assert _denials(after, "TOKEN_INVALID") - _denials(before, "TOKEN_INVALID") == 1
    moved = {code for code in ("DENIED", "ROOT_RESERVED") if _denials(after, code) > _denials(before, code)}
    assert len(moved) == 1, after
    assert "NAME_UNKNOWN" not in {m for m in re.findall(r'cgstore_denials_total\{code="(\w+)"\}', after)}
