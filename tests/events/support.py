"""Helpers of the events feed tests: read the feed, long-poll it in a thread, time answers."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from cgstore_client.wire.fleet import EventsAnswer

EVENTS = "/v1/compiled-graphs:events"


def feed(client: httpx.Client, **params) -> EventsAnswer:
    """One answer of the feed, checked to be exactly the wire type's bytes."""
    response = client.get(EVENTS, params=params)
    assert response.status_code == 200, response.text
    answer = EventsAnswer.model_validate_json(response.content)
    assert response.content == answer.model_dump_json().encode()
    return answer


def head(client: httpx.Client, **params) -> str:
    """A cursor at the feed's head (``since=now``)."""
    answer = feed(client, since="now", **params)
    assert answer.events == []
    return answer.next


@dataclass
class LongPoll:
    """A long-poll running in a thread: its answer and how long it took."""

    thread: threading.Thread
    started: float
    answer: EventsAnswer | None = None
    seconds: float | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def result(self, timeout: float = 60) -> tuple[EventsAnswer, float]:
        assert self.done.wait(timeout), "the long-poll never answered"
        if self.error is not None:
            raise self.error
        return self.answer, self.seconds


def long_poll(store, token: str, **params) -> LongPoll:
    """Start ``GET …:events`` with ``params`` (``wait`` included) in a thread; it is waiting when this returns."""
    poll = LongPoll(thread=threading.Thread(target=lambda: None), started=0.0)
    before = store.context.feed.waiters

    def run() -> None:
        try:
            with store.client(token) as client:
                poll.started = time.monotonic()
                answer = feed(client, **params)
            poll.seconds = time.monotonic() - poll.started
            poll.answer = answer
        except BaseException as err:  # handed to the test by ``result``
            poll.error = err
        finally:
            poll.done.set()

    poll.thread = threading.Thread(target=run, daemon=True)
    poll.thread.start()
    waiting_on(store, at_least=before + 1)
    return poll


def waiting_on(store, *, at_least: int, timeout: float = 10) -> None:
    """Until the store process has ``at_least`` long-polls waiting (its ``HeadWatch``)."""
    deadline = time.monotonic() + timeout
    while store.context.feed.waiters < at_least:
        assert time.monotonic() < deadline, "the long-poll never started waiting"
        time.sleep(0.01)
