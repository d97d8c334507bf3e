"""A closed ``Client``'s events watcher: its long-poll is cut and its thread gone when ``close()`` returns."""

from __future__ import annotations

import threading
import time

import pytest

from cgstore_client import Client
from tests.events.support import waiting_on
from tests.fleet.declaration import ENVELOPE
from tests.support.archives import tiny_inputs, tiny_model
from tests.support.live_store import unique_repo

pytestmark = pytest.mark.torch


def watcher_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "cgstore-events"}


def test_closing_a_client_ends_its_watcher_and_gives_the_store_its_long_poll_back(make_store, tmp_path):
    store = make_store("embedded")
    token = store.mint("w", "acme/*:read")
    before = watcher_threads()
    client = Client(store.base_url, token, cache_dir=tmp_path / "cache", events_wait_s=30)
    booted = client.boot(unique_repo("watched"), tiny_model(0), envelope=ENVELOPE, example_inputs=tiny_inputs(2))
    assert not booted.compiled  # a miss: the handle is followed, and its watcher long-polls for 30 s at a time
    (watcher,) = watcher_threads() - before
    waiting_on(store, at_least=1)
    client.close()
    # Closed: the thread has ended (it would sit in its 30 s long-poll otherwise), so it sends nothing more.
    assert not watcher.is_alive()
    deadline = time.monotonic() + 10  # the store notices the hang-up on its own schedule
    while store.context.feed.waiters and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.context.feed.waiters == 0
