"""A mirror follows its upstream's events feed (issue 27 §1): upstream yanks reach the mirror and its workers'
watchers within the follow wait + 1 s, and a yank made during an outage is applied once the upstream is back.

The module's mirror (one per configuration, ``tests/mirror/conftest.py``) serves every test; each publishes
its own records upstream.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx

from cgstore.mirror import follower
from tests.mirror.support import OWNER, resolve, wait_until
from tests.support.live_store import unique_repo


def held_live(mirror, repo: str, key: str) -> bool:
    """Whether the mirror serves a live record of ``key`` (a yanked one reads as absent)."""
    with mirror.live.client(mirror.worker) as client:
        return client.get(f"/v1/repos/{OWNER}/{repo}/compiled-graphs/{key}").status_code == 200


def feed_cursor(mirror) -> str:
    with mirror.live.client(mirror.worker) as client:
        answer = client.get("/v1/compiled-graphs:events", params={"since": "now", "wait": 0})
        assert answer.status_code == 200, answer.text
        return answer.json()["next"]


def next_events(mirror, since: str, wait_s: float) -> list[dict]:
    """One long-poll of the *mirror's* feed, as a worker's watcher does."""
    with httpx.Client(base_url=mirror.base_url, headers={"Authorization": f"Bearer {mirror.worker}"}, timeout=60) as c:
        answer = c.get("/v1/compiled-graphs:events", params={"since": since, "wait": wait_s})
        assert answer.status_code == 200, answer.text
        return answer.json()["events"]


def storage_page(mirror) -> str:
    """The console's Storage page of the mirror, as its admin sees it."""
    admin = mirror.live.mint("mirror-admin", "*/*:admin")
    with httpx.Client(base_url=mirror.base_url, timeout=60) as console:
        assert console.post("/console/login", data={"token": admin}).status_code == 303
        page = console.get("/console/storage")
        assert page.status_code == 200, page.text
        return page.text


def upstream_section(page: str) -> str:
    return page[page.index('<section class="upstream">') :].split("</section>", 1)[0]


def pulled(upstream, mirror, repo: str):
    """A record published upstream and pulled through the mirror (a worker's resolve)."""
    pub = upstream.publish(repo)
    with mirror.live.client(mirror.worker) as client:
        assert resolve(client, pub.key)["status"] == "hit"
    return pub


def in_sync(mirror) -> None:
    wait_until(lambda: follower.sync_lag_s(mirror.live.context) == 0.0, 30, "the follower to catch up")


def test_an_upstream_yank_reaches_the_mirror_and_its_watchers_within_the_wait(upstream, mirror):
    repo = unique_repo("feed")
    pub = pulled(upstream, mirror, repo)
    in_sync(mirror)
    wait_s = mirror.live.settings.mirror_follow_wait_s
    since = feed_cursor(mirror)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        watching = pool.submit(next_events, mirror, since, 20)
        time.sleep(0.3)  # the watcher's long-poll is open
        upstream.yank(repo, pub.key, reason="miscompiled")
        yanked_at = time.monotonic()
        seen = watching.result(timeout=wait_s + 30)
        latency = time.monotonic() - yanked_at
    assert [(e["kind"], e["key"], e["repo"], e["reason"]) for e in seen] == [
        ("yanked", pub.key, f"{OWNER}/{repo}", "miscompiled")
    ]
    assert latency <= wait_s + 1, latency
    assert not held_live(mirror, repo, pub.key)
    with mirror.live.client(mirror.worker) as client:
        assert resolve(client, pub.key)["status"] == "miss"


def test_a_yank_made_during_an_outage_is_applied_when_the_upstream_is_back(upstream, mirror):
    repo = unique_repo("outage")
    pub = pulled(upstream, mirror, repo)
    kept_repo = unique_repo("kept")
    kept = pulled(upstream, mirror, kept_repo)
    in_sync(mirror)
    mirror.proxy.cut()
    try:
        upstream.yank(repo, pub.key, reason="yanked while the mirror was cut off")
        # The mirror cannot know yet: it still serves its copy, and its lag grows.
        wait_until(lambda: follower.sync_lag_s(mirror.live.context) > 0, 30, "the follower to notice the outage")
        assert held_live(mirror, repo, pub.key)
        # The console shows the mirror degraded and its lag growing; the upstream's URL, never its token.
        with mirror.live.client(mirror.worker) as client:
            assert resolve(client, "ck1-" + "0" * 56)["status"] == "miss"  # asks the upstream: unreachable
        shown = upstream_section(storage_page(mirror))
        assert "degraded" in shown and mirror.live.settings.upstream_url in shown
        assert mirror.upstream_token not in shown
    finally:
        mirror.proxy.restore()
    # Resumed from the saved cursor: the yank lands (the follower's backoff is at most 10 s).
    wait_until(lambda: not held_live(mirror, repo, pub.key), 15, "the yank to land")
    assert held_live(mirror, kept_repo, kept.key)
    in_sync(mirror)
    shown = upstream_section(storage_page(mirror))
    assert "degraded" not in shown and "0.0 s" in shown


def test_a_refused_cursor_is_replaced_by_a_resync_that_yanks_what_the_upstream_no_longer_serves(upstream, mirror):
    """The saved cursor expired (the outage outlasted the upstream's retention): re-check every mirrored record."""
    ctx = mirror.live.context
    repo = unique_repo("resync")
    pub = pulled(upstream, mirror, repo)
    in_sync(mirror)
    mirror.proxy.cut()
    try:
        upstream.yank(repo, pub.key, reason="yanked before the cursor expired")
        # What an expired cursor looks like to the upstream: one it cannot open (400).
        wait_until(lambda: follower.sync_lag_s(ctx) > 0, 30, "the follower to notice the outage")
        follower.write_state(ctx.db, follower.FEED_CURSOR, {"cursor": "expired-cursor"})
    finally:
        mirror.proxy.restore()
    resyncs = ctx.metrics.mirror_resyncs._value.get()
    wait_until(lambda: not held_live(mirror, repo, pub.key), 20, "the resync to yank it")
    assert ctx.metrics.mirror_resyncs._value.get() == resyncs + 1
    in_sync(mirror)
