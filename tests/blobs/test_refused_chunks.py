"""A refused chunk leaves the staged bytes exactly at the committed offset (issue 9, class 6).

A PATCH whose body was shorter than its ``Content-Range`` used to be refused
only after its bytes were staged, and nothing cut them: fifty such chunks left
fifty chunks' worth of dead bytes. The staging is observed in storage itself
(the session's file, or its chunk objects and open multipart parts), not
through the API, on both configurations.
"""

from __future__ import annotations

import os

import blake3

from tests.support.leftovers import staged_session_bytes
from tests.support.live_store import unique_repo


def digest_of(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def test_fifty_refused_chunks_leave_staging_at_the_committed_offset(store):
    name = unique_repo()
    token = store.mint("alice", f"acme/{name}:read,write")
    first = os.urandom(1000)
    with store.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        session_id = location.rsplit("/", 1)[1]
        assert client.patch(location, content=first, headers={"Content-Range": "0-999"}).status_code == 202
        for i in range(50):
            if i % 5 == 4:  # every fifth one longer than its range instead of shorter
                body, declared = os.urandom(3000), "1000-1999"
            else:
                body, declared = os.urandom(20_000), "1000-100999"
            refused = client.patch(location, content=body, headers={"Content-Range": declared})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "SIZE_INVALID", refused.text
            assert staged_session_bytes(store.context.storage, session_id) == len(first), f"after refusal {i}"
        assert client.get(location).headers["upload-offset"] == str(len(first))
        # The session is intact: it resumes at its offset and commits the right bytes.
        rest = os.urandom(500)
        assert client.patch(location, content=rest, headers={"Content-Range": "1000-1499"}).status_code == 202
        assert staged_session_bytes(store.context.storage, session_id) == len(first) + len(rest)
        commit = client.put(location, params={"digest": digest_of(first + rest)})
        assert commit.status_code == 201, commit.text
        got = client.get(f"/v1/repos/acme/{name}/blobs/{digest_of(first + rest)}", follow_redirects=True)
    assert got.content == first + rest
    assert staged_session_bytes(store.context.storage, session_id) is None


def test_refused_first_chunk_stages_nothing(store):
    name = unique_repo()
    token = store.mint("alice", f"acme/{name}:read,write")
    with store.client(token) as client:
        location = client.post(f"/v1/repos/acme/{name}/uploads").headers["location"]
        session_id = location.rsplit("/", 1)[1]
        short = client.patch(location, content=b"a" * 50, headers={"Content-Range": "0-99"})
        assert short.status_code == 400 and short.json()["error"]["code"] == "SIZE_INVALID"
    # fs: the open session's empty staging file; S3: nothing under its prefix.
    assert staged_session_bytes(store.context.storage, session_id) == (None if store.is_s3 else 0)
