"""The store's own URLs never come from the request's ``Host`` header, and answers carrying a token are never
cached (issue 30, section 5), on both configurations.

Without ``CGSTORE_PUBLIC_URL`` a redirect's ``Location`` and a blob URL in a
resolve or discover answer are paths (``/console/login``); with it, they are
under it. A client sending ``Host: evil.example`` sees neither its host in them.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.compiled_graphs.support import CONSTANTS_A, publication, publish, safetensors_bytes, unique_envelope
from tests.support.archives import archive_report
from tests.support.live_store import CONFIGURATIONS, unique_repo

EVIL = {"Host": "evil.example"}
PUBLIC_URL = "https://store.example/registry"


def _evil_client(live, token: str | None = None) -> httpx.Client:
    """A client of ``live`` that says ``Host: evil.example`` (redirects not followed)."""
    headers = {**EVIL, **({"Authorization": f"Bearer {token}"} if token else {})}
    return httpx.Client(base_url=live.base_url, headers=headers, timeout=60, follow_redirects=False)


def _published(live, archive):
    """A record in a fresh repo, and a read token for it: (repo, token, publication)."""
    name = unique_repo("public-url")
    token = live.mint("public-url", f"acme/{name}:read,write")
    pub = publication(
        archive,
        archive_report(archive),
        components={"consts": safetensors_bytes(CONSTANTS_A)},
        envelope=unique_envelope(),
    )
    with live.client(token) as client:
        assert publish(client, "acme", name, pub).status_code == 201
    return f"acme/{name}", token, pub


def _blob_urls(live, token: str, pub) -> list[str]:
    """The artifact and component URLs of ``pub`` in a resolve and a discover answer, asked with a foreign Host."""
    axes = pub.manifest["axes"]
    declaration = {
        "family": pub.manifest["family"],
        "envelope": axes["envelope"],
        "sm": axes["sm"],
        "toolchain": axes["toolchain"],
    }
    with _evil_client(live, token) as client:
        resolved = client.post(
            "/v1/compiled-graphs:resolve", json={"family": pub.manifest["family"], "keys": [pub.key]}
        )
        discovered = client.post("/v1/compiled-graphs:discover", json=declaration)
    assert resolved.status_code == 200 and discovered.status_code == 200, (resolved.text, discovered.text)
    (hit,) = resolved.json()["answers"]
    (candidate,) = discovered.json()["candidates"]
    return [blob["url"] for entry in (hit, candidate) for blob in (entry["artifact"], *entry["components"])]


def _redirects(live, admin: str) -> dict[str, str]:
    """Each kind of redirect the store answers, asked with a foreign Host: what -> its Location."""
    with _evil_client(live) as client:
        answers = {
            "slash": client.get("/console/login/"),  # the router's: the other spelling of a route
            "api slash": client.get("/v1/capabilities/"),
            "sign-in needed": client.get("/console/records"),
            "signed in": client.post("/console/login", data={"token": admin}),
            "signed out": client.post("/console/logout"),
        }
    assert {what: a.status_code for what, a in answers.items()} == {
        "slash": 307,
        "api slash": 307,
        "sign-in needed": 303,
        "signed in": 303,
        "signed out": 303,
    }
    return {what: answer.headers["location"] for what, answer in answers.items()}


def test_without_a_public_url_redirects_and_blob_urls_are_paths(store, pt2_archive):
    assert store.settings.public_url is None
    locations = _redirects(store, store.mint("public-url-admin", "*/*:admin"))
    assert locations == {
        "slash": "/console/login",
        "api slash": "/v1/capabilities",
        "sign-in needed": "/console/login",
        "signed in": "/console",
        "signed out": "/console/login",
    }
    repo, token, pub = _published(store, pt2_archive)
    urls = _blob_urls(store, token, pub)
    assert not any("evil.example" in url for url in urls)
    if not store.is_s3:  # on S3 they are presigned storage URLs (CGSTORE_S3_PUBLIC_ENDPOINT_URL's host)
        digests = [pub.artifact.digest, pub.components["consts"].digest] * 2
        assert urls == [f"/v1/repos/{repo}/blobs/{digest}" for digest in digests]
        with store.client(token) as client:  # a path is fetched from the store the client called
            assert client.get(urls[0]).content == pub.artifact.data


def test_a_slash_redirect_keeps_the_query(store):
    with _evil_client(store) as client:
        kept = client.get("/console/records/", params={"family": "a b", "limit": "5"})
    assert kept.status_code == 307 and kept.headers["location"] == "/console/records?family=a+b&limit=5"


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_with_a_public_url_redirects_and_blob_urls_are_under_it(make_store, pt2_archive, configuration):
    live = make_store(configuration, public_url=PUBLIC_URL + "/", redirect_downloads=False)
    assert live.settings.public_url == PUBLIC_URL  # kept without its trailing slash
    locations = _redirects(live, live.mint("public-url-admin", "*/*:admin"))
    assert locations == {
        "slash": f"{PUBLIC_URL}/console/login",
        "api slash": f"{PUBLIC_URL}/v1/capabilities",
        "sign-in needed": f"{PUBLIC_URL}/console/login",
        "signed in": f"{PUBLIC_URL}/console",
        "signed out": f"{PUBLIC_URL}/console/login",
    }
    repo, token, pub = _published(live, pt2_archive)
    digests = [pub.artifact.digest, pub.components["consts"].digest] * 2
    assert _blob_urls(live, token, pub) == [f"{PUBLIC_URL}/v1/repos/{repo}/blobs/{digest}" for digest in digests]


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_with_a_public_url_the_console_sign_in_form_may_come_from_it(make_store, configuration):
    """Behind a proxy that forwards another Host, the browser's Origin is the public URL's: the store's own."""
    live = make_store(configuration, public_url=PUBLIC_URL)
    admin = live.mint("public-url-admin", "*/*:admin")
    with live.client(follow_redirects=False) as client:
        from_public = client.post("/console/login", data={"token": admin}, headers={"Origin": "https://store.example"})
        from_elsewhere = client.post(
            "/console/login", data={"token": admin}, headers={"Origin": "https://evil.example"}
        )
    assert from_public.status_code == 303 and from_public.headers["location"] == f"{PUBLIC_URL}/console"
    assert from_elsewhere.status_code == 403


@pytest.mark.parametrize(
    "url",
    [
        "store.example",
        "ftp://store.example",
        "https://u:p@store.example",
        "https://store.example/?q=1",
        "https://store.example/#top",
        "https://",
    ],
)
def test_a_public_url_that_is_no_http_url_is_refused_at_start(url):
    from pydantic import ValidationError

    from cgstore.settings import Settings

    with pytest.raises(ValidationError, match="CGSTORE_PUBLIC_URL"):
        Settings(public_url=url)
    assert Settings(public_url="").public_url is None


def test_answers_carrying_a_token_are_not_cached(store):
    admin = store.mint("no-store-admin", "*/*:admin")
    grant = [{"repo": f"acme/{unique_repo()}", "actions": ["read"]}]
    with store.client(admin) as client:
        minted = client.post("/v1/tokens", json={"sub": f"s-{uuid.uuid4().hex[:6]}", "grants": grant, "ttl_s": 600})
        assert minted.status_code == 201, minted.text
    with store.client(minted.json()["token"]) as client:
        child = client.post("/v1/tokens/attenuate", json={"grants": grant, "ttl_s": 60})
        assert child.status_code == 201, child.text
    with store.client(follow_redirects=False) as client:
        signed_in = client.post("/console/login", data={"token": admin})  # the token goes into a cookie
        assert signed_in.status_code == 303
    for answer in (minted, child, signed_in):
        assert answer.headers["cache-control"] == "no-store", answer.request.url
