"""Wire types of the fleet: claims (one mint per declaration) and the record events feed.

A worker that misses claims its declaration in the repo it will publish to
(``POST /v1/repos/{o}/{r}/compiled-graphs:claim``, body a ``ClaimRequest``):
one worker of the fleet is granted the mint, the others hear that it is held
and wait on the events feed (``GET /v1/compiled-graphs:events``) for the
record to be published. The holder beats its claim
(``…/compiled-graphs/claims/{claim}:heartbeat``) and releases it
(``…:release``) published or failed. The feed also carries yanks, which is how
running workers stop serving a withdrawn graph.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field, RootModel

from cgstore_client.wire.discovery import Candidate, Declaration
from cgstore_client.wire.records import MAX_REASON_CHARS, WireModel

#: The longest a long-poll of the events feed may wait, in seconds (``wait``).
MAX_EVENTS_WAIT_S = 30
#: The most events one answer of the feed carries.
MAX_EVENTS_PAGE = 256
#: A claim's id as the store writes it: opaque.
MAX_CLAIM_CHARS = 64


class ClaimRequest(Declaration):
    """The declaration a worker missed and would mint: discover's fields, without its paging."""


class ClaimGranted(WireModel):
    """The caller holds the mint: beat it every ``heartbeat_s`` (a third of the TTL) until releasing it."""

    state: Literal["granted"] = "granted"
    claim: str = Field(max_length=MAX_CLAIM_CHARS)
    expires_at: datetime
    heartbeat_s: float


class ClaimHeld(WireModel):
    """Another worker of the caller's fleet holds the mint since ``since``; it lapses at ``expires_at`` unless beaten."""

    state: Literal["held"] = "held"
    claim: str = Field(max_length=MAX_CLAIM_CHARS)
    since: datetime
    expires_at: datetime


class ClaimPublished(WireModel):
    """A live record the caller may read already matches: nothing to mint (discover's candidates, best first)."""

    state: Literal["published"] = "published"
    candidates: list[Candidate]


class ClaimBackoff(WireModel):
    """The declaration's last mint failed: the next grant waits until ``retry_at`` (60 s × 2^(failures−1), ≤ 1 h)."""

    state: Literal["backoff"] = "backoff"
    retry_at: datetime
    failures: int
    #: The last failure's reason, as its holder released it (or ``expired``).
    reason: str | None = Field(None, max_length=MAX_REASON_CHARS)


class ClaimFailing(WireModel):
    """Five mints in a row failed or expired: none is granted until an admin clears it or the declaration changes."""

    state: Literal["failing"] = "failing"
    failures: int
    since: datetime
    reason: str | None = Field(None, max_length=MAX_REASON_CHARS)


#: What a claim answers, told apart by ``state``.
ClaimAnswer = Annotated[
    ClaimGranted | ClaimHeld | ClaimPublished | ClaimBackoff | ClaimFailing, Field(discriminator="state")
]


class ClaimHeartbeat(WireModel):
    """A beaten claim's new expiry."""

    claim: str = Field(max_length=MAX_CLAIM_CHARS)
    expires_at: datetime


class ReleasePublished(WireModel):
    """The holder published the record ``key`` for the claimed declaration."""

    outcome: Literal["published"] = "published"
    key: str = Field(min_length=1, max_length=96)


class ReleaseFailed(WireModel):
    """The holder could not mint: the first line of why (the next grant backs off)."""

    outcome: Literal["failed"] = "failed"
    reason: str = Field(min_length=1, max_length=MAX_REASON_CHARS)


#: The body of ``…/claims/{claim}:release``.
ClaimRelease = Annotated[ReleasePublished | ReleaseFailed, Field(discriminator="outcome")]


class ClaimReleaseBody(RootModel[ClaimRelease]):
    """``ClaimRelease`` as one model: what the store's bounded JSON reader parses (``.root`` is the release)."""


class ClaimReleased(WireModel):
    """A released claim and how it ended."""

    claim: str = Field(max_length=MAX_CLAIM_CHARS)
    outcome: Literal["published", "failed"]


class RecordEvent(WireModel):
    """A record published or yanked, in the order the store committed them.

    ``published`` carries what discovery matches on (``discovery_digest``,
    ``binding_signature``, ``release``); ``yanked`` the yank's ``reason``.
    """

    kind: Literal["published", "yanked"]
    key: str
    #: ``owner/name``.
    repo: str
    family: str
    discovery_digest: str | None = None
    binding_signature: str | None = None
    release: str | None = None
    reason: str | None = None
    at: datetime


class EventsAnswer(WireModel):
    """The events after the request's cursor (possibly none when ``wait`` ran out), and the cursor to ask next."""

    events: list[RecordEvent]
    #: Opaque, for this reader only: the ``since`` of the next request.
    next: str
