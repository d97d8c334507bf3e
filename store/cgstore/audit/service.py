"""Appending to the audit log and reading it back. Every mutation and every denial goes through here.

Writing: ``record`` adds one entry to the *caller's* session, so the entry
commits or rolls back with the mutation it records (a publish, a mount, a
token mint...). ``record_denial`` writes a refusal in its own transaction,
because the refused request's own work is rolled back. Repeated 401s are
not written one by one: ``audit.denials`` aggregates them.

Every string is stored through ``clean``: backslashes, control characters
(NUL included), every non-ASCII character and lone surrogates are escaped
(``\\x00``, ``\\u043e``, ``\\ud800``), and the result is cut to its column's
bound with a marker. PostgreSQL refuses NUL in text and surrogates in UTF-8,
so without this a hostile path would make the insert fail and the denial
would go unrecorded.

Reading: ``list_events`` filters on the indexed columns and pages by id (keyset);
an action prefix is read action by action, so a rare one costs no more than a common one.
There is deliberately no update or delete here (the migration adds triggers
that refuse them too), and every entry is chained to the one before it
(``audit.chain``), so a change made with the triggers disabled is detectable.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, func, select, union_all
from sqlalchemy.orm import Session

from cgstore.access import is_admin
from cgstore.audit import chain
from cgstore.audit.models import (
    ACTION_LEN,
    ACTOR_LEN,
    JTI_LEN,
    OUTCOME_LEN,
    REPO_LEN,
    SOURCE_LEN,
    TARGET_LEN,
    AuditEvent,
)
from cgstore.core.db import Database, utcnow
from cgstore.core.errors import BadRequest
from cgstore.core.http import parse_row_id
from cgstore.tokens.claims import Claims
from cgstore_client.wire.audit import MAX_AUDIT_PAGE, AuditEntry, AuditPage

log = logging.getLogger(__name__)

# Bounds of what goes into ``detail``: a hostile request cannot grow a row.
DETAIL_STRING_LEN = 512
DETAIL_KEY_LEN = 200
DETAIL_ITEMS = 32
DETAIL_DEPTH = 4
DETAIL_JSON_BYTES = 8 * 1024

DEFAULT_PAGE = 100
# An action prefix naming more distinct actions than this is matched entry by entry instead.
MAX_PREFIX_ACTIONS = 64

_NEEDS_ESCAPE = re.compile("[\\\\\x00-\x1f\x7f-\U0010ffff]")


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    if char == "\\":
        return "\\\\"
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte, as ``surrogateescape`` carries it
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def clean(value: object, limit: int) -> str:
    """``value`` as text any database stores: escaped, and at most ``limit`` characters.

    Non-ASCII becomes ``\\uNNNN`` (a homoglyph never passes for ASCII), bytes that are
    not UTF-8 ``\\xNN``; a value cut short ends with
    ``…[cut from N chars]`` so a reader knows it was.
    """
    text = value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)
    # Escaping never shortens, so escaping a prefix of ``limit`` characters suffices.
    escaped = _NEEDS_ESCAPE.sub(_escape_char, text[: limit + 1])
    if len(escaped) <= limit and len(text) <= limit:
        return escaped
    marker = f"…[cut from {len(text)} chars]"
    return escaped[: max(limit - len(marker), 0)] + marker


def clean_optional(value: object | None, limit: int) -> str | None:
    return None if value is None else clean(value, limit)


def clean_detail(detail: dict[str, Any] | None) -> dict[str, Any]:
    """``detail`` with every string cleaned, containers bounded, and non-JSON values made text."""
    cleaned = _clean_value(detail or {}, DETAIL_DEPTH)
    if not isinstance(cleaned, dict):
        cleaned = {"value": cleaned}
    dumped = json.dumps(cleaned, ensure_ascii=False)
    if len(dumped.encode()) > DETAIL_JSON_BYTES:
        return {"cut": True, "preview": clean(dumped, DETAIL_STRING_LEN)}
    return cleaned


def _clean_value(value: object, depth: int) -> object:
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # JSON has no NaN or Infinity
    if depth <= 0:
        return clean(value, DETAIL_STRING_LEN)
    if isinstance(value, dict):
        items = list(value.items())[:DETAIL_ITEMS]
        return {clean(k, DETAIL_KEY_LEN): _clean_value(v, depth - 1) for k, v in items}
    if isinstance(value, list | tuple | set | frozenset):
        return [_clean_value(v, depth - 1) for v in list(value)[:DETAIL_ITEMS]]
    return clean(value, DETAIL_STRING_LEN)


def record(
    session: Session,
    *,
    actor: str,
    jti: str | None,
    action: str,
    target: str,
    outcome: str = "ok",
    detail: dict[str, Any] | None = None,
    repo: str | None = None,
    source: str | None = None,
    count: int = 1,
    at: dt.datetime | None = None,
) -> None:
    """Add one entry to the caller's unit of work: it commits (or rolls back) with the mutation.

    The entry is chained (``chain.append``): from here until the transaction ends
    it holds the chain head, and other appends wait; so record last.

    ``repo`` is the ``owner/repo`` the entry concerns (what ``GET /v1/audit?repo=``
    matches); ``source`` the client address; ``count`` > 1 only for aggregates.
    """
    chain.append(
        session,
        AuditEvent(
            at=at or utcnow(),
            actor=clean(actor, ACTOR_LEN),
            jti=clean_optional(jti, JTI_LEN),
            action=clean(action, ACTION_LEN),
            target=clean(target, TARGET_LEN),
            repo=clean_optional(repo, REPO_LEN),
            outcome=clean(outcome, OUTCOME_LEN),
            source=clean_optional(source, SOURCE_LEN),
            count=count,
            detail=clean_detail(detail),
        ),
    )


def record_denial(db: Database, **fields: Any) -> None:
    """Record a refusal in its own transaction: the refused request's work is rolled back.

    A denial that cannot be audited (database down) is logged instead; the
    refusal itself still stands.
    """
    try:
        with db.session() as session:
            record(session, **fields)
    except Exception:  # the caller is already answering with an error; don't mask it
        log.exception("could not audit denial %s", fields)


# -- reading ------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditFilter:
    """What ``GET /v1/audit`` and ``cgstore audit`` select. ``None`` means "any".

    ``action`` and ``target`` ending in ``*`` match by prefix (``token.*``,
    ``acme/models@*``); every other filter matches exactly. Values are
    compared in the stored (cleaned) form.
    """

    actor: str | None = None
    jti: str | None = None
    repo: str | None = None
    action: str | None = None
    target: str | None = None
    outcome: str | None = None
    source: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None


def list_events(
    session: Session,
    where: AuditFilter,
    *,
    after: int | None = None,
    limit: int = DEFAULT_PAGE,
    newest_first: bool = False,
) -> tuple[Sequence[AuditEvent], int | None]:
    """One page of entries ordered by id, after the keyset cursor ``after``; and the next cursor.

    The next cursor is the last id of the page when the page is full (there may
    be more), else ``None``. An action prefix is answered action by action
    (``_page_by_action``), so its cost does not grow with the log.
    """
    limit = max(1, min(limit, MAX_AUDIT_PAGE))
    conditions = _conditions(where)
    if after is not None:
        conditions.append(AuditEvent.id < after if newest_first else AuditEvent.id > after)
    order = AuditEvent.id.desc() if newest_first else AuditEvent.id
    prefix = _action_prefix(where)
    actions = None if prefix is None else _actions_starting(session, prefix)
    if actions is None:  # no prefix, or more distinct actions than are worth visiting one by one
        events = session.scalars(select(AuditEvent).where(*conditions).order_by(order).limit(limit)).all()
    else:
        events = _page_by_action(session, actions, conditions, order, limit, newest_first)
    return events, (events[-1].id if len(events) == limit else None)


def _conditions(where: AuditFilter) -> list[ColumnElement[bool]]:
    """The filters as SQL conditions on the stored (cleaned) values."""
    conditions: list[ColumnElement[bool]] = []
    for column, value, bound in (
        (AuditEvent.actor, where.actor, ACTOR_LEN),
        (AuditEvent.jti, where.jti, JTI_LEN),
        (AuditEvent.repo, where.repo, REPO_LEN),
        (AuditEvent.outcome, where.outcome, OUTCOME_LEN),
        (AuditEvent.source, where.source, SOURCE_LEN),
    ):
        if value is not None:
            conditions.append(column == clean(value, bound))
    for column, value, bound in (
        (AuditEvent.action, where.action, ACTION_LEN),
        (AuditEvent.target, where.target, TARGET_LEN),
    ):
        if value is not None and value.endswith("*"):
            conditions.append(column.startswith(clean(value[:-1], bound), autoescape=True))
        elif value is not None:
            conditions.append(column == clean(value, bound))
    if where.since is not None:
        conditions.append(AuditEvent.at >= where.since)
    if where.until is not None:
        conditions.append(AuditEvent.at < where.until)
    return conditions


def _action_prefix(where: AuditFilter) -> str | None:
    """The stored form of an action prefix (``token.*`` → ``token.``); ``None`` when there is none."""
    if where.action is None or not where.action.endswith("*"):
        return None
    return clean(where.action[:-1], ACTION_LEN)


def _actions_starting(session: Session, prefix: str) -> list[str] | None:
    """The distinct actions the log holds that start with ``prefix``, or ``None`` past ``MAX_PREFIX_ACTIONS``.

    A skip scan: each is one seek along the action index, to the first action
    after the last one found. Actions starting with a prefix are contiguous in
    that index because the column compares by code point (SQLite's BINARY, the
    "C" collation on PostgreSQL: migration 0015).
    """
    first = select(AuditEvent.action).order_by(AuditEvent.action).limit(1)
    found: list[str] = []
    action = session.scalar(first.where(AuditEvent.action >= prefix))
    while action is not None and action.startswith(prefix):
        if len(found) == MAX_PREFIX_ACTIONS:
            return None
        found.append(action)
        action = session.scalar(first.where(AuditEvent.action > action))
    return found


def _page_by_action(
    session: Session,
    actions: Sequence[str],
    conditions: Sequence[ColumnElement[bool]],
    order: ColumnElement[Any],
    limit: int,
    newest_first: bool,
) -> Sequence[AuditEvent]:
    """The page among ``actions``: each action's first ``limit`` ids from the ``(action, id)`` index, merged.

    ``conditions`` still hold the prefix's own test; ``action ==`` is what lets the index serve each part.

    Walking the log by id and testing each entry would read all of it for a
    prefix that only rare entries have; a page per action reads at most
    ``limit`` index entries per action, however long the log.
    """
    parts = [
        select(AuditEvent.id).where(AuditEvent.action == action, *conditions).order_by(order).limit(limit).subquery()
        for action in actions
    ]
    if not parts:
        return []
    ids = sorted(session.scalars(union_all(*(select(part.c.id) for part in parts))), reverse=newest_first)[:limit]
    return session.scalars(select(AuditEvent).where(AuditEvent.id.in_(ids)).order_by(order)).all()


def outcome_counts(session: Session, action: str, since: dt.datetime) -> dict[str, int]:
    """How many ``action`` entries since ``since``, per outcome (an aggregate row counts ``count`` times)."""
    rows = session.execute(
        select(AuditEvent.outcome, func.sum(AuditEvent.count))
        .where(AuditEvent.action == action, AuditEvent.at >= since)
        .group_by(AuditEvent.outcome)
    )
    return {outcome: int(n) for outcome, n in rows}


def history(session: Session, targets: Sequence[str], limit: int = DEFAULT_PAGE) -> list[AuditEntry]:
    """The newest entries about any of ``targets`` (compared in the stored form), newest first."""
    cleaned = sorted({clean(target, TARGET_LEN) for target in targets})
    events = session.scalars(
        select(AuditEvent)
        .where(AuditEvent.target.in_(cleaned))
        .order_by(AuditEvent.id.desc())
        .limit(max(1, min(limit, MAX_AUDIT_PAGE)))
    )
    return [to_entry(event) for event in events]


def parse_cursor(cursor: str | None) -> int | None:
    """The id a ``next_cursor`` names; anything else is ``BAD_REQUEST``."""
    if cursor is None:
        return None
    after = parse_row_id(cursor)
    if after is None:
        raise BadRequest("cursor is not one this store handed out", cursor=cursor[:32])
    return after


def read_page(
    db: Database, claims: Claims, where: AuditFilter, cursor: str | None, limit: int, newest_first: bool = False
) -> AuditPage:
    """``GET /v1/audit``: one page for an admin."""
    is_admin(claims).enforce()
    after = parse_cursor(cursor)
    with db.session() as session:
        events, next_id = list_events(session, where, after=after, limit=limit, newest_first=newest_first)
        entries = [to_entry(event) for event in events]
    return AuditPage(entries=entries, next_cursor=None if next_id is None else str(next_id))


def to_entry(event: AuditEvent) -> AuditEntry:
    return AuditEntry(
        id=event.id,
        at=event.at,
        actor=event.actor,
        jti=event.jti,
        action=event.action,
        target=event.target,
        repo=event.repo,
        outcome=event.outcome,
        source=event.source,
        count=event.count,
        detail=event.detail,
    )
