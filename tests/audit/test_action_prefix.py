"""An action prefix (``?action=token.*``) selects exactly the entries a scan of the log would, page by page.

``list_events`` answers a prefix action by action (a skip scan of the action
index, then each action's page from ``(action, id)``), or entry by entry past
``MAX_PREFIX_ACTIONS`` distinct actions. Both are checked against the
definition, on both configurations, with the characters that trip a prefix up:
punctuation on either side of ``.`` in code-point order, case, and ``LIKE``'s
wildcards taken literally.
"""

from __future__ import annotations

import uuid

from sqlalchemy import select

from cgstore.audit.models import AuditEvent
from cgstore.audit.service import MAX_PREFIX_ACTIONS, AuditFilter, _actions_starting, list_events, record
from cgstore.core import migrate
from cgstore.core.db import Database
from tests.audit.conftest import rows
from tests.support import services


def _write(db: Database, actor: str, actions: list[str]) -> None:
    with db.session() as session:
        for action in actions:
            record(session, actor=actor, jti=None, action=action, target=f"{actor}/{action}")


def _paged(db: Database, where: AuditFilter, *, limit: int, newest_first: bool) -> list[int]:
    """Every id the filter selects, by following the next cursors; each page full unless it is the last."""
    ids: list[int] = []
    after: int | None = None
    with db.session() as session:
        while True:
            events, after = list_events(session, where, after=after, limit=limit, newest_first=newest_first)
            ids += [event.id for event in events]
            assert len(events) <= limit and (after is None) == (len(events) < limit)
            if after is None:
                return ids


def _assert_prefixes_select_as_a_scan(db: Database, actor: str, prefixes: list[str]) -> None:
    with db.session() as session:
        written = [
            (row.id, row.action)
            for row in session.scalars(select(AuditEvent).where(AuditEvent.actor == actor).order_by(AuditEvent.id))
        ]
    for prefix in prefixes:
        expected = [id_ for id_, action in written if action.startswith(prefix)]
        where = AuditFilter(actor=actor, action=prefix + "*")
        for limit in (2, 50):
            assert _paged(db, where, limit=limit, newest_first=False) == expected, (prefix, limit)
            assert _paged(db, where, limit=limit, newest_first=True) == expected[::-1], (prefix, limit)


def test_a_prefix_pages_exactly_the_entries_whose_action_starts_with_it(store):
    tag = "p" + uuid.uuid4().hex[:6]
    actor = f"prefix-{tag}"
    # '-' < '.' < '/' < 'z' by code point; '%' and '_' are LIKE's wildcards; case differs.
    actions = [
        f"{tag}.read",
        f"{tag}.write",
        f"{tag}-x",
        f"{tag}/y",
        f"{tag}z",
        tag,
        f"{tag}.%a",
        f"{tag}._b",
        f"{tag}.Read",
        f"{tag.upper()}.read",
        f"{tag}.r",
    ]
    _write(store.context.db, actor, [actions[(i * 7) % len(actions)] for i in range(3 * len(actions))])
    prefixes = [
        "",
        tag[:3],
        tag,
        f"{tag}.",
        f"{tag}.r",
        f"{tag}.read",
        f"{tag}-",
        f"{tag}/",
        f"{tag}z",
        f"{tag}.%",
        f"{tag}._",
        f"{tag}.R",
        tag.upper(),
        f"{tag}.rea",
        f"{tag}.read.more",
        f"{tag}.x",
    ]
    _assert_prefixes_select_as_a_scan(store.context.db, actor, prefixes)
    with store.context.db.session() as session:
        assert _actions_starting(session, f"{tag}.") == sorted(
            [f"{tag}.%a", f"{tag}.Read", f"{tag}._b", f"{tag}.r", f"{tag}.read", f"{tag}.write"]
        )
        assert _actions_starting(session, f"{tag}.x") == []


def test_a_prefix_with_more_distinct_actions_than_the_skip_scan_visits_is_matched_entry_by_entry(store):
    tag = "m" + uuid.uuid4().hex[:6]
    actor = f"prefix-{tag}"
    actions = [f"{tag}.{i:03d}" for i in range(MAX_PREFIX_ACTIONS + 6)] + [f"{tag}.%{i}" for i in range(3)]
    _write(store.context.db, actor, actions)
    with store.context.db.session() as session:
        assert _actions_starting(session, f"{tag}.") is None  # this prefix takes the other path
        assert len(_actions_starting(session, f"{tag}.06")) == 10
    _assert_prefixes_select_as_a_scan(store.context.db, actor, [f"{tag}.", f"{tag}.%", f"{tag}.0", f"{tag}.06"])


def test_other_filters_apply_within_each_action(store):
    tag = "f" + uuid.uuid4().hex[:6]
    with store.context.db.session() as session:
        for i in range(12):
            record(
                session,
                actor=f"prefix-{tag}",
                jti=None,
                action=f"{tag}.{'ab'[i % 2]}",
                target=f"t{i}",
                outcome="ok" if i % 3 else "DENIED",
                repo=f"acme/{tag}" if i < 8 else None,
            )
    denied = [
        row.id
        for row in rows(
            store, AuditEvent.actor == f"prefix-{tag}", AuditEvent.outcome == "DENIED", AuditEvent.repo == f"acme/{tag}"
        )
    ]
    assert len(denied) == 3
    where = AuditFilter(action=f"{tag}.*", outcome="DENIED", repo=f"acme/{tag}")
    assert _paged(store.context.db, where, limit=2, newest_first=True) == denied[::-1]
    assert _paged(store.context.db, where, limit=2, newest_first=False) == denied


def test_a_prefix_holds_on_a_postgresql_database_whose_collation_is_not_code_point_order():
    """ICU's en-US puts ``Key.b`` between ``key.a`` and ``key.c``: actions sharing a prefix would not be
    contiguous in the index, and a skip scan would stop at ``Key.b``. The column compares in "C" (migration 0015)."""
    icu = "TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US'"
    with services.postgres_database("cgstore_icu", icu) as url:
        migrate.upgrade(url)
        db = Database(url)
        try:
            _write(db, "icu", ["key.a", "Key.b", "key.c", "key-d", "key/e", "keyf"])
            _assert_prefixes_select_as_a_scan(db, "icu", ["key.", "Key.", "key", "k", "key-", "key/"])
            with db.session() as session:
                assert _actions_starting(session, "key.") == ["key.a", "key.c"]
        finally:
            db.dispose()
