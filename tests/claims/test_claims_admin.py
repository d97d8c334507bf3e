"""What admins see of claims and do about failing declarations: the console's overview and ``cgstore claims``."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from cgstore.claims import service
from cgstore.cli import app
from tests.claims.support import claim, fresh_declaration, release
from tests.console.conftest import sign_in
from tests.support.live_store import CONFIGURATIONS, unique_repo


def make_failing(store, client, name: str, declaration: dict) -> None:
    """Five failed mints in a row (the store's backoff is a few tens of milliseconds)."""
    for failures in range(1, service.FAILING_AFTER + 1):
        deadline = time.monotonic() + 10
        while (answer := claim(client, "acme", name, declaration)).state == "backoff":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert answer.state == "granted", answer
        done = release(client, "acme", name, answer.claim, {"outcome": "failed", "reason": f"compile error {failures}"})
        assert done.status_code == 200, done.text
    assert claim(client, "acme", name, declaration).state == "failing"


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_the_overview_shows_mints_in_flight_and_clears_a_failing_declaration(make_store, configuration):
    store = make_store(configuration, claim_backoff_s=0.02)
    name = unique_repo()
    token = store.mint("minter-x", f"acme/{name}:read,write")
    admin = store.mint("console-admin", "*/*:admin")
    failing = fresh_declaration(release="bad-release")
    with store.client(token) as client:
        make_failing(store, client, name, failing)
        assert claim(client, "acme", name, fresh_declaration()).state == "granted"
        with sign_in(store, admin) as console:
            page = console.get("/console").text
            assert "Mints in flight" in page and f"acme/{name}" in page and "minter-x" in page
            assert "Failing declarations" in page and "compile error 5" in page and "bad-release" in page
            with store.context.db.session() as session:
                (view,) = [v for v in service.failing(session, 1000) if v.repo == f"acme/{name}"]
            assert f'action="/console/claims/{view.id}/clear"' in page
            foreign = console.post(f"/console/claims/{view.id}/clear", headers={"Origin": "https://evil.example"})
            assert foreign.status_code == 403
            assert claim(client, "acme", name, failing).state == "failing"
        with store.client() as anonymous:  # no console cookie: to the sign-in page, nothing cleared
            assert anonymous.post(f"/console/claims/{view.id}/clear").status_code == 303
        assert claim(client, "acme", name, failing).state == "failing"
        with sign_in(store, admin) as console:
            assert console.post("/console/claims/999999999/clear").status_code == 404
            cleared = console.post(f"/console/claims/{view.id}/clear")
            assert cleared.status_code == 303
        assert claim(client, "acme", name, failing).state == "granted"


def cli(store, *args: str):
    env = {"CGSTORE_DATABASE_URL": store.settings.resolved_database_url, "CGSTORE_HOME": str(store.settings.home)}
    return CliRunner().invoke(app, ["claims", *args], env=env)


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_cgstore_claims_lists_and_clears_failing_declarations(make_store, configuration):
    store = make_store(configuration, claim_backoff_s=0.02)
    name = unique_repo()
    token = store.mint("minter-y", f"acme/{name}:read,write")
    declaration = fresh_declaration()
    with store.client(token) as client:
        make_failing(store, client, name, declaration)
        listed = cli(store, "list", "--failing")
        assert listed.exit_code == 0, listed.output
        mine = [line for line in map(json.loads, listed.output.splitlines()) if line["repo"] == f"acme/{name}"]
        assert [(line["failures"], line["reason"]) for line in mine] == [(5, "compile error 5")]
        assert cli(store, "clear", "999999999").exit_code == 1
        cleared = cli(store, "clear", str(mine[0]["id"]))
        assert cleared.exit_code == 0, cleared.output
        assert claim(client, "acme", name, declaration).state == "granted"
        in_flight = cli(store, "list")
        assert any(json.loads(line)["holder"] == "minter-y" for line in in_flight.output.splitlines())
