"""Two store instances on one database race claims of one declaration: exactly one is granted, every time."""

from __future__ import annotations

import contextlib
import threading

import pytest

from tests.claims.support import claim, fresh_declaration, release
from tests.support.live_store import CONFIGURATIONS, running_store, session_servers, settings_for, unique_repo

ROUNDS = 6  # each a real race of 8 claimers over two replicas; 24 per run across slots and configurations
CLAIMERS = 8


@pytest.fixture(params=CONFIGURATIONS)
def two_replicas(request, tmp_path_factory):
    """Two running stores of one registry: one SQLite file, or one PostgreSQL database and bucket; one signing key."""
    configuration = request.param
    first_home = tmp_path_factory.mktemp(f"claims-a-{configuration}")
    servers = session_servers(request, configuration)
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(running_store(settings_for(configuration, first_home, **servers), configuration))
        shared = {"token_signing_key": first.settings.signing_key_path}
        if configuration == "embedded":
            shared["database_url"] = first.settings.resolved_database_url
            shared["storage_url"] = first.settings.resolved_storage_url
        second_home = tmp_path_factory.mktemp(f"claims-b-{configuration}")
        second = stack.enter_context(
            running_store(settings_for(configuration, second_home, **servers, **shared), configuration)
        )
        yield first, second


@pytest.mark.parametrize("slot", ["new", "existing"])
def test_racing_claims_across_replicas_grant_exactly_one(two_replicas, slot):
    """``new``: the declaration's row and its repo are created by the race; ``existing``: a claim ended before
    (the row exists, unheld), so only the row's lock decides."""
    first, second = two_replicas
    for _ in range(ROUNDS):
        name = unique_repo()
        tokens = [first.mint(f"worker-{i}", f"acme/{name}:read,write") for i in range(CLAIMERS)]
        declaration = fresh_declaration()
        if slot == "existing":
            with first.client(tokens[0]) as client:
                ended = claim(client, "acme", name, declaration)
                done = release(client, "acme", name, ended.claim, {"outcome": "published", "key": "ck1-" + "b" * 56})
                assert done.status_code == 200, done.text
        barrier = threading.Barrier(CLAIMERS)
        answers = [None] * CLAIMERS

        def race(i: int) -> None:
            replica = (first, second)[i % 2]
            with replica.client(tokens[i]) as client:
                barrier.wait()
                answers[i] = claim(client, "acme", name, declaration)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(CLAIMERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        states = sorted(answer.state for answer in answers)
        assert states == ["granted"] + ["held"] * (CLAIMERS - 1), states
        assert len({answer.claim for answer in answers}) == 1
