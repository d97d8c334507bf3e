"""Claims over HTTP: ask for a declaration's mint, beat it, release it (``wire.fleet``).

Shared by the worker (:mod:`cgstore_client.worker.fleet`, which claims) and the
mint child (:mod:`cgstore_client.worker.mint_child`, which beats and releases):
both speak to the store through a :class:`~cgstore_client.worker.http.Transport`,
so the token only ever goes to the store's origin and every answer is parsed
with its wire type.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from pydantic import TypeAdapter, ValidationError

from cgstore_client.errors import CgstoreError, Refused
from cgstore_client.wire.discovery import Declaration
from cgstore_client.wire.fleet import (
    ClaimAnswer,
    ClaimHeartbeat,
    ClaimReleased,
    ClaimRequest,
    ReleaseFailed,
    ReleasePublished,
)
from cgstore_client.wire.records import MAX_REASON_CHARS
from cgstore_client.worker.http import Transport, parse_answer, split_repo, store_path

_ANSWER = TypeAdapter(ClaimAnswer)
log = logging.getLogger(__name__)


def claim_request(declaration: Declaration) -> ClaimRequest:
    """The claim body of a declaration (a discover request's paging and ``explain`` left out)."""
    return ClaimRequest.model_validate(declaration.model_dump(include=set(ClaimRequest.model_fields)))


def claim(transport: Transport, repo: str, declaration: Declaration) -> ClaimAnswer:
    """Ask ``repo`` for the mint of ``declaration``: granted, held, published, backoff or failing."""
    owner, name = split_repo(repo)
    body = claim_request(declaration).model_dump(mode="json", exclude_none=True)
    # Not retried blindly: a granted answer lost in transit would come back "held" by ourselves.
    # The caller's loop asks again after a pause, and a claim it lost lapses at its TTL.
    response = transport.request("POST", store_path("v1", "repos", owner, name, "compiled-graphs:claim"), json=body)
    try:
        return _ANSWER.validate_json(response.content)
    except ValidationError as err:
        raise Refused(f"the store's answer is not a claim answer: {err}") from None


def _claim_path(repo: str, claim_id: str, action: str) -> str:
    owner, name = split_repo(repo)
    return store_path("v1", "repos", owner, name, "compiled-graphs", "claims", f"{claim_id}:{action}")


def heartbeat(transport: Transport, repo: str, claim_id: str) -> ClaimHeartbeat:
    """Extend the claim ``claim_id`` by its TTL (only its holder's principal may)."""
    response = transport.request("POST", _claim_path(repo, claim_id, "heartbeat"), retry=False)
    return parse_answer(ClaimHeartbeat, response.content)


def release_published(transport: Transport, repo: str, claim_id: str, key: str) -> ClaimReleased:
    """End the claim: the record ``key`` was published for its declaration."""
    body = ReleasePublished(key=key).model_dump(mode="json")
    return parse_answer(
        ClaimReleased, transport.request("POST", _claim_path(repo, claim_id, "release"), json=body).content
    )


def release_failed(transport: Transport, repo: str, claim_id: str, reason: str) -> ClaimReleased:
    """End the claim as failed with ``reason``'s first line (the next grant of the declaration backs off)."""
    body = ReleaseFailed(reason=first_line(reason)).model_dump(mode="json")
    return parse_answer(
        ClaimReleased, transport.request("POST", _claim_path(repo, claim_id, "release"), json=body).content
    )


def first_line(text: str) -> str:
    """The first non-blank line of an error, bounded to what the wire carries."""
    line = next((line.strip() for line in str(text).splitlines() if line.strip()), "") or "unknown error"
    return line[:MAX_REASON_CHARS]


@contextlib.contextmanager
def beating(transport: Transport, repo: str, claim_id: str, every_s: float) -> Iterator[None]:
    """Beat ``claim_id`` every ``every_s`` while the block runs (a worker's export, before its child beats)."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            try:
                heartbeat(transport, repo, claim_id)
            except CgstoreError as err:  # retried at the next beat; a lost claim costs a duplicate mint, no more
                log.info("cgstore: heartbeat of claim %s: %s", claim_id, err)

    thread = threading.Thread(target=beat, name="cgstore-beat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
