"""A hidden miss takes as long as an absent one: another tenant's private record or blob is not told apart by time.

In a ``principal`` repo bob's read of alice's record (or HEAD of alice's blob)
answers the same 404 as a read of something absent (``test_private_caches``).
Before, it also answered ~2 ms later: the hidden miss wrote its denial row
inline, so in 88–93 % of interleaved pairs the hidden read was the slower one.

A sign test over ``PAIRS`` interleaved pairs (hidden, absent), in alternating
order, over one keep-alive connection: the fraction of pairs in which the
hidden read is the slower must be what chance gives, within ``FAIR``. The
machine's other load only adds noise, which pulls the fraction towards 0.5;
the control (absent against absent) checks the measurement itself. Every
hidden read is still audited. Both configurations (``store``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import httpx
import pytest
from sqlalchemy import select

from cgstore.repos.models import Repo
from tests.compiled_graphs.support import (
    CONSTANTS_A,
    FAMILY,
    clone_records,
    make_repos,
    publication,
    publish,
    safetensors_bytes,
    unique_envelope,
)
from tests.compiled_graphs.test_discover import declaration
from tests.security.test_private_caches import jti_of
from tests.support.archives import archive_report
from tests.support.audit import audited
from tests.support.live_store import unique_repo

PAIRS = 240
WARM_UP = 10
#: Chance gives 0.5 ± 0.032 (one standard deviation for 240 pairs): the bounds are ±4.7 of those. The
#: leak this test was written for measured 68–84 % (88–93 % at 80 pairs); a hidden miss that only
#: queued its audit row while an absent one did nothing still measured 65 % on a quiet machine, so
#: both now queue (``audit.denials.defer``). The production blob HEAD still measured 61 % over 1500
#: pairs: telling the hidden miss apart took a lookup that found a row only for it. In a private
#: cache the request no longer asks (the audit's flush does, ``maybe_hidden_miss``): 48–52 % over
#: 1500 pairs on all four reads.
FAIR = (0.35, 0.65)


@pytest.fixture
def cache(store, pt2_archive):
    """A ``principal`` repo where alice published one record; bob may read it (and sees none of alice's)."""
    name = unique_repo("timing")
    manager = store.mint("ops", f"acme/{name}:admin")
    with store.client(manager) as client:
        assert client.put(f"/v1/repos/acme/{name}", json={"visibility": "principal"}).status_code == 201
    pub = publication(pt2_archive, archive_report(pt2_archive), components={"consts": safetensors_bytes(CONSTANTS_A)})
    with store.client(store.mint("alice", f"acme/{name}:read,write")) as client:
        assert publish(client, "acme", name, pub).status_code == 201
    return {"name": name, "pub": pub, "bob": store.mint("bob", f"acme/{name}:read")}


def other_key(key: str, position: int) -> str:
    """A valid key of the same shape that nobody published: ``key`` with one hex digit changed."""
    digit = "0" if key[position] != "0" else "1"
    return key[:position] + digit + key[position:][1:]


def absent_digest() -> str:
    return "blake3:" + uuid.uuid4().hex * 2


def elapsed(client: httpx.Client, method: str, path: str, *, status: int = 404, body: dict | None = None) -> float:
    start = time.perf_counter()
    answer = client.request(method, path, json=body)
    took = time.perf_counter() - start
    assert answer.status_code == status, answer.text
    return took


def slower_fraction(client: httpx.Client, method: str, first: str, second: str) -> float:
    """The fraction of ``PAIRS`` interleaved pairs in which ``first`` answered slower than ``second``."""
    return slower_fraction_of(lambda: elapsed(client, method, first), lambda: elapsed(client, method, second))


def slower_fraction_of(first: Callable[[], float], second: Callable[[], float]) -> float:
    """The fraction of ``PAIRS`` interleaved pairs in which the send ``first`` took longer than ``second``.

    The pair's first send alternates, so whatever a send leaves behind for the
    next one (a background write, a warm cache) weighs on both sides alike.
    """
    for _ in range(WARM_UP):
        first()
        second()
    slower = 0
    for pair in range(PAIRS):
        if pair % 2 == 0:
            a, b = first(), second()
        else:
            b, a = second(), first()
        slower += a > b
    return slower / PAIRS


def reads(cache) -> dict[str, tuple[str, str, str, str]]:
    """Per read: its method, alice's (hidden from bob), an absent one, and another absent one."""
    name, pub = cache["name"], cache["pub"]
    blobs = f"/v1/repos/acme/{name}/blobs"
    records = f"/v1/repos/acme/{name}/compiled-graphs"
    return {
        "record get": (
            "GET",
            pub.path("acme", name),
            f"{records}/{other_key(pub.key, -1)}",
            f"{records}/{other_key(pub.key, -2)}",
        ),
        "blob head": (
            "HEAD",
            f"{blobs}/{pub.artifact.digest}",
            f"{blobs}/{absent_digest()}",
            f"{blobs}/{absent_digest()}",
        ),
    }


@pytest.mark.parametrize("what", ["record get", "blob head"])
def test_a_hidden_miss_takes_as_long_as_an_absent_one(store, cache, what):
    method, hidden, absent, other_absent = reads(cache)[what]
    started = time.monotonic()
    with store.client(cache["bob"]) as client:
        control = slower_fraction(client, method, other_absent, absent)
        leak = slower_fraction(client, method, hidden, absent)
    print(
        f"{store.configuration} {what}: hidden slower in {leak:.0%} of pairs (control {control:.0%}) in {time.monotonic() - started:.1f} s"
    )
    assert FAIR[0] <= control <= FAIR[1], f"the measurement itself is unfair: control {control:.0%}"
    assert FAIR[0] <= leak <= FAIR[1], f"a hidden {what} answered slower than an absent one in {leak:.0%} of pairs"
    # Off the request path, still every one: a row per hidden read (the test flushes the log).
    target = cache["pub"].key if what == "record get" else cache["pub"].artifact.digest
    outcome = "NAME_UNKNOWN" if what == "record get" else "BLOB_UNKNOWN"
    rows = audited(store, outcome, target=target, jti=jti_of(cache["bob"]))
    assert sum(row.count for row in rows) == PAIRS + WARM_UP


# -- discover and resolve: hidden records cost nothing (issue 30 §2) -------------------------------

#: Hidden records of the larger case: half other tenants' in bob's private cache, half in repos bob cannot search.
MANY_HIDDEN = 400


@pytest.fixture
def searched_cache(store, pt2_archive):
    """A ``principal`` repo bob may read and search (a grant naming it); alice's record of a declaration no other
    test uses is there, hidden from bob."""
    name = unique_repo("search-timing")
    manager = store.mint("ops", f"acme/{name}:admin")
    with store.client(manager) as client:
        assert client.put(f"/v1/repos/acme/{name}", json={"visibility": "principal"}).status_code == 201
    pub = publication(
        pt2_archive,
        archive_report(pt2_archive),
        components={"consts": safetensors_bytes(CONSTANTS_A)},
        envelope=unique_envelope(),
    )
    with store.client(store.mint("alice", f"acme/{name}:read,write")) as client:
        assert publish(client, "acme", name, pub).status_code == 201
    return {"name": name, "pub": pub, "bob": store.mint("bob", f"acme/{name}:read")}


def hide_more(store, cache, count: int) -> None:
    """``count`` more records of alice's declaration and key that bob cannot see: other tenants' in his
    private cache, and copies in repos of a tenant he holds nothing of (what anyone can make by mounting)."""
    with store.context.db.session() as session:
        cache_id = session.scalar(select(Repo.id).where(Repo.owner == "acme", Repo.name == cache["name"]))
    key = cache["pub"].key
    copies = [(cache_id, f"tenant-{tenant}", key) for tenant in range(count // 2)]
    owner = f"evil-{uuid.uuid4().hex[:8]}"
    store.mint("mallory", f"{owner}/*:read,write")  # registers mallory, who holds the owner
    repo_ids = make_repos(store, owner, [f"copy-{n}" for n in range(count - count // 2)], holder="mallory")
    clone_records(store, key, copies + [(repo_id, "mallory", key) for repo_id in repo_ids])


def searches(cache) -> dict[str, tuple[dict, dict, dict]]:
    """Per search: its body for alice's hidden record, for something absent, and for something else absent.

    Each pair answers the same bytes (``{"candidates":[]}``; a miss of a key of one length)."""
    pub = cache["pub"]
    return {
        "discover": (
            declaration(pub),
            declaration(pub, envelope=unique_envelope()),
            declaration(pub, envelope=unique_envelope()),
        ),
        "resolve": (
            {"family": FAMILY, "keys": [pub.key]},
            {"family": FAMILY, "keys": [other_key(pub.key, -1)]},
            {"family": FAMILY, "keys": [other_key(pub.key, -2)]},
        ),
    }


@pytest.mark.parametrize("what", ["discover", "resolve"])
def test_records_a_caller_cannot_see_do_not_slow_its_search(store, searched_cache, what):
    """Before, both loaded every live match across tenants and filtered in Python: with 404 hidden records
    a discover took 9.6 ms against 3.7 ms, slower in 149 of 150 pairs.

    One case, ``MANY_HIDDEN`` records: alice's own (what a single hidden record measured, in a case of its
    own until 2026-12-07), other tenants' in bob's cache and copies in repos he cannot search."""
    hide_more(store, searched_cache, MANY_HIDDEN - 1)
    hidden_body, absent, other_absent = searches(searched_cache)[what]
    path = f"/v1/compiled-graphs:{what}"
    started = time.monotonic()
    with store.client(searched_cache["bob"]) as client:

        def send(body: dict) -> Callable[[], float]:
            return lambda: elapsed(client, "POST", path, status=200, body=body)

        assert client.post(path, json=hidden_body).content == client.post(path, json=absent).content.replace(
            absent.get("keys", [""])[0].encode(), hidden_body.get("keys", [""])[0].encode()
        )
        control = slower_fraction_of(send(other_absent), send(absent))
        leak = slower_fraction_of(send(hidden_body), send(absent))
    print(
        f"{store.configuration} {what} with {MANY_HIDDEN} hidden: slower in {leak:.0%} of pairs (control {control:.0%}) "
        f"in {time.monotonic() - started:.1f} s"
    )
    assert FAIR[0] <= control <= FAIR[1], f"the measurement itself is unfair: control {control:.0%}"
    assert FAIR[0] <= leak <= FAIR[1], f"{what} with {MANY_HIDDEN} hidden records was slower in {leak:.0%} of pairs"
