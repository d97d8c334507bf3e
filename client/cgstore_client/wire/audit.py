"""Wire types of ``GET /v1/audit`` (docs/protocol.md "Audit"): one entry, and one page of them.

Strings in an entry are as stored: backslashes, control characters, non-ASCII
and lone surrogates escaped (``\\x00``, ``\\u043e``), each cut to its column's
bound with a ``…[cut from N chars]`` marker. ``count`` is 1 except for aggregate rows of
repeated 401s (action ``auth``), where it is how many 401s the row stands for.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel, Field

MAX_AUDIT_PAGE = 1000


class AuditEntry(BaseModel):
    id: int = Field(description="Increasing; pages are cut by it (keyset).")
    at: dt.datetime = Field(description="When it happened (an aggregate: its first 401).")
    actor: str = Field(description="The token's sub, or '-' without a valid token.")
    jti: str | None = Field(description="The token's id, never the token.")
    action: str = Field(description="e.g. blob.upload, token.mint, 'GET /v1/…' for a denial, auth for an aggregate.")
    target: str = Field(description="What the action was on: a repo@digest, a jti, a request path.")
    repo: str | None = Field(description="owner/repo the entry concerns, if any.")
    outcome: str = Field(description="ok, or the protocol error code of the refusal.")
    source: str | None = Field(description="Client address of a denial ('*': sources beyond the per-interval bound).")
    count: int = Field(description="Events the row stands for: 1, or the 401s aggregated into it.")
    detail: dict[str, Any] = Field(description="Extra facts.")


class AuditPage(BaseModel):
    entries: list[AuditEntry]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null when this page is the last.")
