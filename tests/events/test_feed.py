"""The record events feed (issue 26 §2): publishes and yanks the token may read, in commit order, long-polled.

Both configurations (``store``, ``make_store``, ``make_registry``); real
archives published and yanked through the HTTP API.
"""

from __future__ import annotations

import datetime as dt
import threading
import time

import httpx
import pytest
from sqlalchemy import select

from cgstore.compiled_graphs import events
from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphEvent
from cgstore.core.db import utcnow
from cgstore_client.wire.fleet import MAX_EVENTS_WAIT_S
from tests.compiled_graphs.support import error_code, publish, upload_all
from tests.events.support import EVENTS, feed, head, long_poll
from tests.support.live_store import unique_repo

ADMIN = ("store-admin", "*/*:admin")


def repo_with(store, *, visibility: str = "owner") -> tuple[str, str]:
    """A repo ``acme/<name>`` of the visibility, and a manager's token."""
    name = unique_repo("feed")
    manager = store.mint("ops", f"acme/{name}:admin")
    with store.client(manager) as client:
        assert client.put(f"/v1/repos/acme/{name}", json={"visibility": visibility}).status_code == 201
    return name, manager


def yank(store, name: str, pub, reason: str, **body) -> None:
    with store.client(store.mint(*ADMIN)) as client:
        answer = client.post(f"{pub.path('acme', name)}:yank", json={"reason": reason, **body})
    assert answer.status_code == 200, answer.text


def record_row(store, name: str, key: str) -> CompiledGraph:
    with store.context.db.session() as session:
        return session.scalar(select(CompiledGraph).where(CompiledGraph.key == key).order_by(CompiledGraph.id.desc()))


def test_publishes_and_yanks_arrive_in_commit_order_with_what_discovery_matches_on(store, publications):
    name, _ = repo_with(store)
    minter = store.mint("minter", f"acme/{name}:read,write")
    reader = store.mint("reader", f"acme/{name}:read")
    first, second = publications(release="rel-1"), publications()
    with store.client(reader) as client:
        cursor = head(client)
    with store.client(minter) as client:
        assert publish(client, "acme", name, first).status_code == 201
        assert publish(client, "acme", name, second).status_code == 201
        assert publish(client, "acme", name, first).status_code == 200  # the same bytes again: no event
    yank(store, name, first, "bad numerics")
    with store.client(reader) as client:
        answer = feed(client, since=cursor)
        again = feed(client, since=answer.next)
    assert [(e.kind, e.key) for e in answer.events] == [
        ("published", first.key),
        ("published", second.key),
        ("yanked", first.key),
    ]
    published, _, yanked = answer.events
    row = record_row(store, name, first.key)
    assert (published.repo, published.family, published.release) == (f"acme/{name}", first.manifest["family"], "rel-1")
    assert (published.discovery_digest, published.binding_signature) == (row.discovery_digest, row.binding_signature)
    assert published.reason is None
    assert (yanked.repo, yanked.reason, yanked.discovery_digest) == (f"acme/{name}", "bad numerics", None)
    assert published.at <= answer.events[1].at <= yanked.at
    assert again.events == []
    # The cursor is opaque and new each time: two cursors at one position differ.
    assert again.next != answer.next and len(again.next) == len(answer.next)


def test_since_now_and_no_since_start_at_the_head(store, publications):
    name, _ = repo_with(store)
    minter = store.mint("minter", f"acme/{name}:read,write")
    with store.client(minter) as client:
        assert publish(client, "acme", name, publications()).status_code == 201
        from_now, from_nothing = feed(client, since="now"), feed(client)
        later = publications()
        assert publish(client, "acme", name, later).status_code == 201
        assert from_now.events == from_nothing.events == []
        for cursor in (from_now.next, from_nothing.next):
            assert [e.key for e in feed(client, since=cursor).events] == [later.key]


def test_a_long_poll_answers_as_soon_as_a_visible_event_arrives(store, publications):
    name, _ = repo_with(store)
    minter = store.mint("minter", f"acme/{name}:read,write")
    pub = publications()
    with store.client(minter) as client:
        cursor = head(client)
        upload_all(client, "acme", name, pub)  # before the clock starts: only the publish itself is timed
    poll = long_poll(store, minter, since=cursor, wait=20)
    with store.client(minter) as client:
        assert client.put(pub.path("acme", name), json=pub.manifest).status_code == 201
    answer, seconds = poll.result()
    assert [(e.kind, e.key) for e in answer.events] == [("published", pub.key)]
    assert seconds < 3, seconds
    poll = long_poll(store, minter, since=answer.next, wait=20)
    yank(store, name, pub, "withdrawn")
    answer, seconds = poll.result()
    assert [(e.kind, e.key) for e in answer.events] == [("yanked", pub.key)]
    assert seconds < 3, seconds


def test_a_long_poll_with_nothing_new_answers_empty_when_its_wait_runs_out(store):
    token = store.mint("idle", f"acme/{unique_repo()}:read")
    with store.client(token) as client:
        cursor = head(client)
    answer, seconds = long_poll(store, token, since=cursor, wait=1).result()
    assert answer.events == [] and 0.9 < seconds < 3, seconds


def test_another_tenant_s_private_events_are_told_by_neither_content_count_nor_timing(store, publications):
    """B long-polls while A publishes in A's private cache: B answers when its wait runs out, empty; B's own
    publish there answers B's long-poll at once; the feed shows each tenant its own events only."""
    name, _ = repo_with(store, visibility="principal")
    alice = store.mint("alice", f"acme/{name}:read,write")
    bob = store.mint("bob", f"acme/{name}:read,write")
    with store.client(alice) as client:
        alice_cursor = head(client)
    with store.client(bob) as client:
        bob_cursor = head(client)
    hers = publications()
    poll = long_poll(store, bob, since=bob_cursor, wait=2)
    with store.client(alice) as client:
        assert publish(client, "acme", name, hers).status_code == 201
    answer, seconds = poll.result()
    assert answer.events == [] and seconds >= 1.9, seconds
    # A yank of alice's record is alice's too.
    yank(store, name, hers, "hers only", publisher="alice")
    with store.client(bob) as client:
        assert feed(client, since=answer.next).events == []
    his = publications()
    with store.client(bob) as client:
        upload_all(client, "acme", name, his)
    poll = long_poll(store, bob, since=answer.next, wait=20)
    with store.client(bob) as client:
        assert client.put(his.path("acme", name), json=his.manifest).status_code == 201
    answer, seconds = poll.result()
    assert [(e.kind, e.key) for e in answer.events] == [("published", his.key)] and seconds < 3, seconds
    with store.client(alice) as client:
        assert [(e.kind, e.key) for e in feed(client, since=alice_cursor).events] == [
            ("published", hers.key),
            ("yanked", hers.key),
        ]


def test_a_reader_sees_only_the_repos_it_searches_and_the_family_it_asks_for(store, publications):
    mine, _ = repo_with(store)
    theirs, _ = repo_with(store)
    reader = store.mint("reader", f"acme/{mine}:read,write")
    other = store.mint("other", f"acme/{theirs}:read,write")
    with store.client(reader) as client:
        cursor = head(client)
    family_a, family_b = publications(family="feed-a"), publications(family="feed-b")
    with store.client(reader) as client:
        assert publish(client, "acme", mine, family_a).status_code == 201
        assert publish(client, "acme", mine, family_b).status_code == 201
    with store.client(other) as client:
        assert publish(client, "acme", theirs, publications(family="feed-a")).status_code == 201
    with store.client(reader) as client:
        assert [e.key for e in feed(client, since=cursor).events] == [family_a.key, family_b.key]
        assert [e.key for e in feed(client, since=cursor, family="feed-b").events] == [family_b.key]
        assert feed(client, since=cursor, family="feed-c").events == []


@pytest.mark.parametrize(
    "params",
    [
        {"wait": str(MAX_EVENTS_WAIT_S + 1)},
        {"wait": "-1"},
        {"wait": "1.5"},
        {"wait": "+1"},
        {"since": "x" * 200},
        {"family": "x" * 101},
    ],
)
def test_parameters_out_of_bounds_are_bad_requests(store, params):
    with store.client(store.mint("reader", "acme/x:read")) as client:
        answer = client.get(EVENTS, params=params)
    assert answer.status_code == 400 and error_code(answer) == "BAD_REQUEST", answer.text


def test_a_family_outside_its_grammar_is_name_invalid(store):
    with store.client(store.mint("reader", "acme/x:read")) as client:
        answer = client.get(EVENTS, params={"family": "Not A Family"})
    assert answer.status_code == 400 and error_code(answer) == "NAME_INVALID"


def test_another_reader_s_cursor_a_forged_one_and_a_listing_s_are_refused(store, publications):
    name, _ = repo_with(store)
    alice = store.mint("alice", f"acme/{name}:read,write")
    alice_again = store.mint("alice", f"acme/{name}:read")
    bob = store.mint("bob", f"acme/{name}:read")
    with store.client(alice) as client:
        cursor = head(client)
        assert publish(client, "acme", name, publications()).status_code == 201
        listing = client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={"limit": 1})
    with store.client(alice) as client:
        assert publish(client, "acme", name, publications()).status_code == 201
        listing_cursor = client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={"limit": 1}).json()
    assert listing.status_code == 200
    with store.client(alice_again) as client:  # the same reader with another token: its cursor opens
        assert len(feed(client, since=cursor).events) == 2
    forged = cursor[:-2] + ("AA" if cursor[-2:] != "AA" else "BB")
    with store.client(bob) as client:
        for refused in (cursor, forged, "0", listing_cursor["next_cursor"]):
            answer = client.get(EVENTS, params={"since": refused})
            assert answer.status_code == 400 and error_code(answer) == "BAD_REQUEST", (refused, answer.text)


def test_ids_are_gapless_and_every_event_arrives_under_concurrent_publishes_and_yanks(store, publications):
    name, _ = repo_with(store)
    minter = store.mint("minter", f"acme/{name}:read,write")
    admin = store.mint(*ADMIN)
    pubs = [publications() for _ in range(6)]
    with store.client(minter) as client:
        cursor = head(client)
        for pub in pubs:  # the blobs first: then the publishes themselves race
            upload_all(client, "acme", name, pub)

    def race(token: str, send) -> list[int]:
        barrier, statuses = threading.Barrier(len(pubs)), []

        def one(pub) -> None:
            with store.client(token) as client:
                barrier.wait()
                statuses.append(send(client, pub).status_code)

        threads = [threading.Thread(target=one, args=(pub,)) for pub in pubs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        return statuses

    assert race(minter, lambda client, pub: client.put(pub.path("acme", name), json=pub.manifest)) == [201] * 6
    yanked = race(admin, lambda client, pub: client.post(f"{pub.path('acme', name)}:yank", json={"reason": "r"}))
    assert yanked == [200] * 6
    with store.client(minter) as client:
        answer = feed(client, since=cursor)
    assert sorted(e.key for e in answer.events[:6]) == sorted(p.key for p in pubs)
    assert {e.kind for e in answer.events[:6]} == {"published"}
    assert sorted(e.key for e in answer.events[6:]) == sorted(p.key for p in pubs)
    assert {e.kind for e in answer.events[6:]} == {"yanked"}
    with store.context.db.session() as session:
        ids = list(session.scalars(select(CompiledGraphEvent.id).order_by(CompiledGraphEvent.id)))
    assert ids == list(range(ids[0], ids[0] + len(ids)))


@pytest.mark.parametrize("configuration", ["embedded", "production"])
def test_long_polls_past_the_process_bound_are_unavailable_with_retry_after(make_store, configuration):
    store = make_store(configuration, events_max_waiters=1)
    token = store.mint("reader", "acme/x:read")
    with store.client(token) as client:
        cursor = head(client)
    poll = long_poll(store, token, since=cursor, wait=2)
    with store.client(token) as client:
        refused = client.get(EVENTS, params={"since": cursor, "wait": 2})
        at_once = client.get(EVENTS, params={"since": cursor})  # no wait: no place needed
    assert refused.status_code == 503 and error_code(refused) == "UNAVAILABLE"
    assert refused.headers["retry-after"] == "1"
    assert at_once.status_code == 200
    assert poll.result()[0].events == []
    # A client that hangs up gives its place back at once, not when its wait runs out.
    impatient = httpx.Client(base_url=store.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=0.5)
    with impatient as client, pytest.raises(httpx.ReadTimeout):
        client.get(EVENTS, params={"since": cursor, "wait": 30})
    deadline = time.monotonic() + 5
    while store.context.feed.waiters and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.context.feed.waiters == 0


@pytest.mark.parametrize("configuration", ["embedded", "production"])
def test_old_events_are_trimmed_and_a_cursor_older_than_the_horizon_says_so(make_registry, configuration, publications):
    store = make_registry(configuration)
    name, _ = repo_with(store)
    minter = store.mint("minter", f"acme/{name}:read,write")
    with store.client(minter) as client:
        old_cursor = head(client)  # before any event: position 0
        first, second = publications(), publications()
        assert publish(client, "acme", name, first).status_code == 201
        between = feed(client, since=old_cursor).next
        assert publish(client, "acme", name, second).status_code == 201
    later = utcnow() + dt.timedelta(seconds=store.settings.events_retention_s + 60)
    assert events.trim(store.context, now=later) == 1  # the newest is kept
    with store.client(minter) as client:
        expired = client.get(EVENTS, params={"since": old_cursor})
        assert [e.key for e in feed(client, since=between).events] == [second.key]
        assert feed(client, since="now").events == []
    assert expired.status_code == 400 and error_code(expired) == "BAD_REQUEST"
    assert expired.json()["error"]["detail"]["expired"] is True
