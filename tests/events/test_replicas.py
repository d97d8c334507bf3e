"""The feed across replicas (issue 26 §2): a publish or yank through one store instance reaches a long-poll
waiting on another instance of the same registry within a second (its ``HeadWatch`` polls the head)."""

from __future__ import annotations

import time

from tests.compiled_graphs.support import upload_all
from tests.events.support import head, long_poll
from tests.support.live_store import unique_repo


def test_a_publish_and_a_yank_on_one_replica_reach_a_long_poll_on_the_other_within_a_second(replicas, publications):
    first, second = replicas
    name = unique_repo("feed")
    owner = first.mint("ops", f"acme/{name}:admin")
    with first.client(owner) as client:
        assert client.put(f"/v1/repos/acme/{name}", json={"visibility": "owner"}).status_code == 201
    minter = first.mint("minter", f"acme/{name}:read,write")
    pub = publications()
    with first.client(minter) as client:
        cursor = head(client)
        upload_all(client, "acme", name, pub)
    poll = long_poll(second, minter, since=cursor, wait=20)
    with first.client(minter) as client:
        published = client.put(pub.path("acme", name), json=pub.manifest)
    committed = time.monotonic()
    assert published.status_code == 201, published.text
    answer, _ = poll.result()
    arrived = time.monotonic() - committed
    assert [(e.kind, e.key) for e in answer.events] == [("published", pub.key)]
    assert arrived < 1.0, arrived
    poll = long_poll(second, minter, since=answer.next, wait=20)
    with first.client(first.mint("store-admin", "*/*:admin")) as client:
        yanked = client.post(f"{pub.path('acme', name)}:yank", json={"reason": "withdrawn"})
    committed = time.monotonic()
    assert yanked.status_code == 200, yanked.text
    answer, _ = poll.result()
    arrived = time.monotonic() - committed
    assert [(e.kind, e.key, e.reason) for e in answer.events] == [("yanked", pub.key, "withdrawn")]
    assert arrived < 1.0, arrived
