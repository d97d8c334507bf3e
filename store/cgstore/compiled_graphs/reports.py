"""Drift reports: a worker's disagreement with a readable record, counted and audited, never a yank.

Limited per principal (the root of the token chain) and per record over a
window, counted over the audit log so replicas agree; the reason is capped.
"""

from __future__ import annotations

import datetime as dt
import math

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from cgstore.audit.models import ACTOR_LEN, TARGET_LEN, AuditEvent
from cgstore.audit.service import DETAIL_STRING_LEN, clean
from cgstore.audit.service import record as audit
from cgstore.compiled_graphs.models import CompiledGraph
from cgstore.compiled_graphs.records import components_of, readable_record, to_record
from cgstore.context import StoreContext
from cgstore.core.db import utcnow
from cgstore.core.errors import (
    MetadataInvalid,
    RateLimited,
)
from cgstore.tokens.claims import Claims
from cgstore_client.wire.discovery import DriftReport
from cgstore_client.wire.records import (
    Record,
)

ACTION_REPORT = "compiled_graph.report"


#: Drift reports one principal may make per ``REPORT_WINDOW_S``, over all its tokens (beyond: 429, ``Retry-After``).
REPORTS_PER_WINDOW = 10


#: Drift reports one record may receive per ``REPORT_WINDOW_S``, from all principals together.
REPORTS_PER_RECORD = 3


REPORT_WINDOW_S = 60


#: Longest drift-report reason (a diagnostic line: the client's names two graph digests in about 190).
MAX_REPORT_REASON_CHARS = 256


def report_drift(ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str, report: DriftReport) -> Record:
    """Count a worker's report that the record's graph is not its live model; audited, never yanks.

    Any token that can read the record may report (others get the 404 an absent
    key gets). Two limits count the report entries in the audit log, after
    appending this one: the principal's (``sub``: attenuation keeps it, so a
    token's children share their root's count) and the record's. Appends are
    serialized by the chain head, so racing reports cannot all slip under a
    limit, and a refused one leaves nothing (its transaction rolls back).
    """
    if len(report.reason) > MAX_REPORT_REASON_CHARS:
        raise MetadataInvalid(
            f"reason is longer than {MAX_REPORT_REASON_CHARS} characters", field="reason", limit=MAX_REPORT_REASON_CHARS
        )
    target_name = f"{owner}/{repo}:{key}"
    with ctx.db.session() as session:
        target, live = readable_record(session, ctx, claims, owner, repo, key)
        session.execute(
            update(CompiledGraph)
            .where(CompiledGraph.id == live.id)
            .values(drift_reports=CompiledGraph.drift_reports + 1)
        )
        audit(
            session,
            actor=claims.sub,
            jti=claims.jti,
            action=ACTION_REPORT,
            target=target_name,
            repo=f"{owner}/{repo}",
            detail={
                "measured_graph": report.measured_graph,
                "reason": report.reason,
                "graph": live.graph_digest,
                "publisher": live.publisher,
            },
        )
        _within_report_limits(session, claims, target_name, live.publisher)
        session.refresh(live)
        components = components_of(session, [live.id])
    return to_record(target, live, components.get(live.id, []))


def _within_report_limits(session: Session, claims: Claims, target: str, publisher: str) -> None:
    """The principal's limit, then the record's; each counted over the audit log's last ``REPORT_WINDOW_S``.

    Entries are matched in their stored form (``audit.service.clean``). A record
    is its audit target and its publisher: in a private cache each publisher's
    record of a key is its own, so one tenant's reports never count against, or
    reveal, another's record of the same key.
    """
    since = utcnow() - dt.timedelta(seconds=REPORT_WINDOW_S)
    reports = (AuditEvent.action == ACTION_REPORT, AuditEvent.at >= since)
    by_principal = AuditEvent.actor == clean(claims.sub, ACTOR_LEN)
    on_record = (
        AuditEvent.target == clean(target, TARGET_LEN),
        AuditEvent.detail["publisher"].as_string() == clean(publisher, DETAIL_STRING_LEN),
    )
    limits = (((by_principal,), REPORTS_PER_WINDOW, "principal"), (on_record, REPORTS_PER_RECORD, "record"))
    for where, limit, per in limits:
        made, oldest = session.execute(select(func.count(), func.min(AuditEvent.at)).where(*reports, *where)).one()
        if made > limit:
            wait = REPORT_WINDOW_S - (utcnow() - oldest).total_seconds()
            raise RateLimited(
                f"at most {limit} drift reports per {per} per {REPORT_WINDOW_S} s",
                retry_after_s=max(1, math.ceil(wait)),
                limit=limit,
                per=per,
            )
