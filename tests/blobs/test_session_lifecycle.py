"""Upload-session behaviours no test held (issue 9, class 12), on both configurations.

Each is observed where a planted bug would show: the session rows in the
database and the staged bytes in storage, not only the API's answers.

- two chunks racing at one offset never both land (the offset's compare-and-set);
- cancelling a session reclaims its staged bytes;
- a digest mismatch at commit consumes the session;
- the reaper deletes expired session rows.
"""

from __future__ import annotations

import datetime as dt
import os
import queue
import threading

import blake3
from sqlalchemy import select, update

from cgstore.blobs import service as blobs_service
from cgstore.blobs.models import UploadSession
from cgstore.core.db import utcnow
from tests.support.leftovers import staged_session_bytes
from tests.support.live_store import unique_repo


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def session_row(store, session_id: str) -> UploadSession | None:
    with store.context.db.session() as session:
        return session.scalar(select(UploadSession).where(UploadSession.id == session_id))


def open_session(client, name: str) -> tuple[str, str]:
    location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
    return location, location.rsplit("/", 1)[1]


def test_two_chunks_racing_at_one_offset_never_both_land(store, monkeypatch):
    """Both chunks are staged from offset 0 before either records it; exactly one wins.

    The real stage writers run one after the other (the fs backend's lock refuses
    an overlapping append outright, which is not the race under test), and the
    second records its offset only once the first has answered.
    """
    name = unique_repo()
    token = store.mint("alice", f"acme/{name}:read,write")
    size = 64 * 1024
    storage = store.context.storage
    real_stage_writer = storage.stage_writer
    serial = threading.Lock()  # one append after the other: the first staged is the first to record
    finished: list[object] = []
    both_staged = threading.Barrier(2, timeout=30)
    first_answered = threading.Event()

    class RacingWriter:
        """The real stage writer; its finish waits until both chunks are staged."""

        def __init__(self, staged, length=None) -> None:
            serial.acquire()
            self._inner = real_stage_writer(staged, length)
            self._holding = True

        def write(self, chunk: bytes) -> None:
            self._inner.write(chunk)

        def finish(self):
            after = self._inner.finish()
            finished.append(after)
            index = len(finished) - 1
            self._let_go()
            both_staged.wait()  # neither has recorded its offset yet: both read offset 0
            if index == 1:
                assert first_answered.wait(30)
            return after

        def abort(self) -> None:
            self._inner.abort()
            self._let_go()

        def _let_go(self) -> None:
            if self._holding:
                self._holding = False
                serial.release()

        def __enter__(self):
            return self

        def __exit__(self, exc_type, exc, tb) -> None:
            if exc_type is not None:
                self.abort()

    monkeypatch.setattr(storage, "stage_writer", RacingWriter)
    answers: queue.Queue = queue.Queue()
    with store.client(token) as client:
        location, session_id = open_session(client, name)

        def send(payload: bytes) -> None:
            with store.client(token) as racer:
                response = racer.patch(location, content=payload, headers={"Content-Range": f"0-{size - 1}"})
            answers.put((payload, response))

        payloads = [b"a" * size, b"b" * size]
        threads = [threading.Thread(target=send, args=(payload,)) for payload in payloads]
        for thread in threads:
            thread.start()
        winner, first = answers.get(timeout=60)
        first_answered.set()
        loser, second = answers.get(timeout=60)
        for thread in threads:
            thread.join()
        monkeypatch.undo()

        assert (first.status_code, second.status_code) == (202, 416), (first.text, second.text)
        assert second.json()["error"]["code"] == "RANGE_INVALID"
        assert client.get(location).headers["upload-offset"] == str(size)
        assert session_row(store, session_id).offset == size
        # The loser's bytes were reclaimed: storage holds exactly the winner's chunk.
        assert staged_session_bytes(storage, session_id) == size
        # What is staged is the winner's chunk, byte for byte.
        assert client.put(location, params={"digest": digest_of(winner)}).status_code == 201
        got = client.get(f"/v1/repos/acme/{name}/blobs/{digest_of(winner)}", follow_redirects=True)
    assert got.content == winner != loser


def test_cancel_reclaims_staged_bytes(store):
    name = unique_repo()
    token = store.mint("alice", f"acme/{name}:read,write")
    data = os.urandom(300_000)
    with store.client(token) as client:
        location, session_id = open_session(client, name)
        for start in range(0, len(data), 100_000):
            chunk = data[start : start + 100_000]
            headers = {"Content-Range": f"{start}-{start + len(chunk) - 1}"}
            assert client.patch(location, content=chunk, headers=headers).status_code == 202
        assert staged_session_bytes(store.context.storage, session_id) == len(data)
        assert client.delete(location).status_code == 204
    assert staged_session_bytes(store.context.storage, session_id) is None
    assert session_row(store, session_id) is None


def test_digest_mismatch_at_commit_consumes_the_session(store):
    name = unique_repo()
    token = store.mint("alice", f"acme/{name}:read,write")
    data = os.urandom(80_000)
    with store.client(token) as client:
        location, session_id = open_session(client, name)
        assert client.patch(location, content=data, headers={"Content-Range": f"0-{len(data) - 1}"}).status_code == 202
        mismatch = client.put(location, params={"digest": digest_of(b"other bytes")})
        assert mismatch.status_code == 400 and mismatch.json()["error"]["code"] == "DIGEST_INVALID"
        for method in ("GET", "PATCH", "PUT"):
            again = client.request(
                method,
                location,
                params={"digest": digest_of(data)},
                content=b"x",
                headers={"Content-Range": f"{len(data)}-{len(data)}"},
            )
            assert again.status_code == 404 and again.json()["error"]["code"] == "BLOB_UPLOAD_UNKNOWN", method
    assert session_row(store, session_id) is None
    assert staged_session_bytes(store.context.storage, session_id) is None
    assert store.context.storage.size(digest_of(data)) is None


def test_reaper_deletes_expired_session_rows_and_their_bytes(store):
    name = unique_repo()
    token = store.mint("alice", f"acme/{name}:read,write")
    with store.client(token) as client:
        expired_location, expired_id = open_session(client, name)
        live_location, live_id = open_session(client, name)
        for location in (expired_location, live_location):
            assert client.patch(location, content=b"z" * 5000, headers={"Content-Range": "0-4999"}).status_code == 202
    with store.context.db.session() as session:
        session.execute(
            update(UploadSession)
            .where(UploadSession.id == expired_id)
            .values(expires_at=utcnow() - dt.timedelta(seconds=1))
        )
    assert blobs_service.reap_expired_sessions(store.context) >= 1
    assert session_row(store, expired_id) is None
    assert staged_session_bytes(store.context.storage, expired_id) is None
    # The live session is untouched, rows and bytes.
    assert session_row(store, live_id).offset == 5000
    assert staged_session_bytes(store.context.storage, live_id) == 5000
