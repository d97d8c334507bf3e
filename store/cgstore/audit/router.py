"""HTTP endpoint of the audit log (docs/protocol.md "Audit"): ``GET /v1/audit`` for admins. Thin."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from starlette.concurrency import run_in_threadpool

from cgstore.audit import service
from cgstore.context import StoreContext, get_context
from cgstore.core.http import QueryInt, parse_utc
from cgstore.tokens.claims import Claims
from cgstore.tokens.dependencies import require_claims
from cgstore_client.wire.audit import MAX_AUDIT_PAGE, AuditPage

router = APIRouter(prefix="/v1/audit", tags=["audit"])

Text = Annotated[str | None, Query(max_length=1024)]


@router.get("", response_model=AuditPage)
async def list_audit(
    actor: Text = None,
    jti: Text = None,
    repo: Text = None,
    action: Text = None,
    target: Text = None,
    outcome: Text = None,
    source: Text = None,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    cursor: Annotated[str | None, Query(max_length=32)] = None,
    limit: Annotated[QueryInt, Query(ge=1, le=MAX_AUDIT_PAGE)] = service.DEFAULT_PAGE,
    order: Literal["asc", "desc"] = "asc",
    claims: Claims = Depends(require_claims),
    ctx: StoreContext = Depends(get_context),
) -> AuditPage:
    """The audit log, filtered and keyset-paged: every mutation and every denial (admin)."""
    where = service.AuditFilter(
        actor=actor,
        jti=jti,
        repo=repo,
        action=action,
        target=target,
        outcome=outcome,
        source=source,
        since=parse_utc(since, "since"),
        until=parse_utc(until, "until"),
    )
    return await run_in_threadpool(service.read_page, ctx.db, claims, where, cursor, limit, order == "desc")
