"""The console's pages as view-models, built only from the feature services the JSON routes and the CLI use.

No query of its own: records come from ``admin.service`` (the host's ``cgstore
ls/show/stats``), the log from ``audit.service``, tokens and keys from the
token service, receipts from ``compiled_graphs.receipts``, a declaration's
miss explained by ``compiled_graphs.search`` (discover's own), bytes from
``blobs.service``, leases from ``operations.leases``, mints in flight and
failing declarations from ``claims.service``. Every function takes the
verified claims and enforces the admin rule first (``access.is_admin``), as
``GET /v1/admin/stats`` and ``GET /v1/audit`` do.

Private caches: the console shows what the host's admin views show, and those
read every live record, private caches' included (the JSON API hides them from
every grant, admin too). Each such record carries ``private`` and the pages
badge it. An admin token is the whole store (it may mint any token, yank any
record): hiding the records from the store's own view would protect nothing.

Query text arrives as typed (``None`` for an empty form field); anything this
module cannot use is ``BadRequest``, which the router shows on the page (400).

The overview's and the storage page's figures are whole-registry aggregates
(GROUP BY and SUM over every live record, blob and week of audit entries): at
100 k records they take a few hundred milliseconds however the database runs
them. So ``Aggregates`` computes each at most once per
``CGSTORE_CONSOLE_AGGREGATES_S`` per process, in the background once there are
figures to show meanwhile (older ones, with their time), and the page says
when they were computed. Every other
page reads live, bounded by its page size.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from markupsafe import Markup
from pydantic import ValidationError

from cgstore.access import is_admin
from cgstore.admin import service as admin
from cgstore.audit import service as audit
from cgstore.blobs import service as blobs
from cgstore.claims import service as claims_service
from cgstore.compiled_graphs import explain, receipts, search
from cgstore.compiled_graphs.publishing import ACTION_PUBLISH
from cgstore.console import charts
from cgstore.context import StoreContext
from cgstore.core.db import utcnow
from cgstore.core.errors import BadRequest, KeyConflict, NameUnknown, StoreError
from cgstore.core.http import parse_number
from cgstore.core.names import validate_owner, validate_repo
from cgstore.mirror import follower as mirror_follower
from cgstore.mirror import service as mirror
from cgstore.operations import leases
from cgstore.tokens.claims import Claims
from cgstore.tokens.ring import KeyInfo
from cgstore.tokens.service import TokenInfo
from cgstore_client.wire.admin import AdminStats, RecordSummary, StorageBytes
from cgstore_client.wire.audit import MAX_AUDIT_PAGE, AuditEntry
from cgstore_client.wire.discovery import DiscoverRequest
from cgstore_client.wire.records import MAX_LIST_LIMIT, Record
from cgstore_client.wire.tokens import MAX_TOKEN_PAGE

#: Rows per page of the records, audit and tokens pages (each at most its JSON listing's bound).
PAGE_ROWS = 50
#: Entries of a record's history.
HISTORY_ROWS = 50
#: Days of the storage page's growth chart.
GROWTH_DAYS = 30
#: The overview's windows over the audit log.
WINDOWS = (("24 h", dt.timedelta(hours=24)), ("7 d", dt.timedelta(days=7)))
#: What a records page cursor is sealed to (``core.cursors``): it opens on no other listing.
_RECORDS_SCOPE = "console-records"

T = TypeVar("T")
log = logging.getLogger(__name__)


class Aggregates(Generic[T]):
    """One set of figures per store context, recomputed at most once per ``max_age_s`` (0: on every call).

    Figures older than ``max_age_s`` are still answered, with their time, while
    one background thread computes the next (stale-while-recompute): no view waits
    for a whole-registry aggregate except the first, and a burst of first views
    computes once. A recomputation that fails leaves the previous figures (and
    the next stale view tries again).
    """

    def __init__(self, compute: Callable[[StoreContext], T]) -> None:
        self._compute = compute
        self._lock = threading.Lock()  # guards the two dicts below, never held while computing
        self._first = threading.Lock()  # held while computing a context's first figures
        # Per store context (a process may serve several), held weakly: a context's figures go with it,
        # and a later context never inherits them (as it could when keyed by a reused ``id()``).
        self._cached: weakref.WeakKeyDictionary[StoreContext, tuple[float, T]] = weakref.WeakKeyDictionary()
        self._refreshing: weakref.WeakSet[StoreContext] = weakref.WeakSet()

    def get(self, ctx: StoreContext) -> T:
        max_age_s = ctx.settings.console_aggregates_s
        if max_age_s <= 0:
            return self._compute(ctx)
        if (cached := self._cached_or_refresh(ctx, max_age_s)) is not None:
            return cached
        with self._first:
            if (cached := self._cached_or_refresh(ctx, max_age_s)) is not None:
                return cached  # computed by the view this one waited for
            value = self._compute(ctx)
            with self._lock:
                self._cached[ctx] = (time.monotonic(), value)
            return value

    def _cached_or_refresh(self, ctx: StoreContext, max_age_s: float) -> T | None:
        """The cached figures, however old (starting their recomputation if too old); None if there are none."""
        with self._lock:
            cached = self._cached.get(ctx)
            if cached is None:
                return None
            if time.monotonic() - cached[0] >= max_age_s and ctx not in self._refreshing:
                self._refreshing.add(ctx)
                threading.Thread(target=self._refresh, args=(ctx,), name="console-aggregates", daemon=True).start()
            return cached[1]

    def _refresh(self, ctx: StoreContext) -> None:
        try:
            value = self._compute(ctx)
            with self._lock:
                self._cached[ctx] = (time.monotonic(), value)
        except Exception:  # the previous figures stay; the next stale view tries again
            log.exception("recomputing the console's aggregates failed")
        finally:
            with self._lock:
                self._refreshing.discard(ctx)


def page_limit(limit: str | None, bound: int) -> int:
    """The ``limit`` query value: 1..``bound`` (default ``PAGE_ROWS``, never more than ``bound``)."""
    if limit is None:
        return min(PAGE_ROWS, bound)
    rows = parse_number(limit)  # ASCII digits only: str.isdigit() and int() also read "१" as 1
    if rows is None or not 1 <= rows <= bound:
        raise BadRequest(f"limit must be a whole number from 1 to {bound}", limit=limit[:16])
    return rows


# -- overview ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Publishes:
    """Publish attempts in one window of the audit log, by outcome."""

    window: str
    published: int  # ``ok``: created, or the same bytes again
    conflicts: int  # ``KEY_CONFLICT``: a non-reproducible mint
    refused: int  # every other refusal (admission, access), aggregates counted whole

    @classmethod
    def of(cls, window: str, outcomes: dict[str, int]) -> Publishes:
        published, conflicts = outcomes.get("ok", 0), outcomes.get(KeyConflict.code, 0)
        return cls(window, published, conflicts, sum(outcomes.values()) - published - conflicts)


@dataclass(frozen=True)
class Overview:
    stats: AdminStats
    #: Live records per family, per sm and per lane: ``{"family": [(value, records), ...], ...}``, most first.
    by_axis: dict[str, list[tuple[str, int]]]
    publishes: list[Publishes]
    #: Live records per unhealthy state (a link each).
    unhealthy_states: list[tuple[str, int]]
    computed_at: dt.datetime
    #: Read live on every view (not aggregates): mints running now, and declarations no claim is granted for.
    in_flight: list[claims_service.SlotView] = field(default_factory=list)
    failing: list[claims_service.SlotView] = field(default_factory=list)
    now: dt.datetime | None = None


def overview(ctx: StoreContext, claims: Claims) -> Overview:
    is_admin(claims).enforce()
    with ctx.db.session() as session:
        in_flight = claims_service.in_flight(session, PAGE_ROWS)
        failing = claims_service.failing(session, PAGE_ROWS)
    return dataclasses.replace(_overview.get(ctx), in_flight=in_flight, failing=failing, now=utcnow())


def clear_failing(ctx: StoreContext, claims: Claims, slot: str) -> claims_service.SlotView:
    """The overview's "Clear" on a failing declaration (``cgstore claims clear`` on the host): admin only."""
    slot_id = parse_number(slot)
    if slot_id is None:
        raise NameUnknown("no such claimed declaration", id=slot[:32])
    return claims_service.clear_as_admin(ctx, claims, slot_id)


def _overview_facts(ctx: StoreContext) -> Overview:
    now = utcnow()
    with ctx.db.session() as session:
        stats = admin.stats(session)
        unhealthy = admin.health_counts(session)
        publishes = [
            Publishes.of(name, audit.outcome_counts(session, ACTION_PUBLISH, now - span)) for name, span in WINDOWS
        ]
    by_axis: dict[str, dict[str, int]] = {"family": defaultdict(int), "sm": defaultdict(int), "lane": defaultdict(int)}
    for count in stats.records:
        for axis in by_axis:
            by_axis[axis][getattr(count, axis)] += count.records
    return Overview(
        stats=stats,
        by_axis={
            axis: sorted(counts.items(), key=lambda item: (-item[1], item[0])) for axis, counts in by_axis.items()
        },
        publishes=publishes,
        unhealthy_states=sorted(unhealthy.items()),
        computed_at=now,
    )


_overview = Aggregates(_overview_facts)


# -- records -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordsPage:
    records: list[RecordSummary]
    next_cursor: str | None


def records(
    ctx: StoreContext, claims: Claims, where: admin.RecordFilter, cursor: str | None, limit: str | None
) -> RecordsPage:
    is_admin(claims).enforce()
    rows = page_limit(limit, MAX_LIST_LIMIT)
    if where.repo is not None:
        owner, slash, name = where.repo.partition("/")
        if not slash:
            raise BadRequest("repo is owner/name", repo=where.repo[:141])
        validate_owner(owner)
        validate_repo(name)
    before = ctx.cursors.open(_RECORDS_SCOPE, cursor) if cursor is not None else None
    with ctx.db.session() as session:
        page, next_id = admin.records_page(session, where, before=before, limit=rows)
    return RecordsPage(page, None if next_id is None else ctx.cursors.seal(_RECORDS_SCOPE, next_id))


@dataclass(frozen=True)
class RecordView:
    record: Record
    private: bool
    receipt: receipts.ReceiptCheck
    fit_chart: Markup | None
    history: list[AuditEntry]
    #: The artifact and each component: ``(name, digest, size)``; the sum is ``total_bytes``.
    blobs: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, _, size in self.blobs)


def record(ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str) -> list[RecordView]:
    """The live records of ``key`` in ``owner/repo`` (several only in a private cache); ``NameUnknown`` if none."""
    is_admin(claims).enforce()
    validate_owner(owner)
    validate_repo(repo)
    with ctx.db.session() as session:
        found = admin.shown(session, key, repo=f"{owner}/{repo}")
        if not found:
            raise NameUnknown("no live record of this key in this repo", key=key[:120])
        jwks = ctx.tokens.ring.jwks(session)
        views = []
        for shown, private in found:
            files = [("artifact (.pt2)", shown.manifest.artifact.digest, shown.manifest.artifact.size)]
            files += [(c.name, c.digest, c.size) for c in shown.manifest.components]
            # Publish, yank and drift reports name the record; health changes name its blobs.
            targets = [f"{shown.repo}:{shown.key}", *(digest for _, digest, _ in files)]
            views.append(
                RecordView(
                    record=shown,
                    private=private,
                    receipt=receipts.check(shown, jwks, issuer=ctx.settings.token_issuer),
                    fit_chart=charts.fit_chart(shown.kernel_lane),
                    history=audit.history(session, targets, HISTORY_ROWS),
                    blobs=files,
                )
            )
    return views


# -- audit -------------------------------------------------------------------------------


def parse_moment(value: str | None, name: str) -> dt.datetime | None:
    """An ISO 8601 time from a form (``datetime-local`` sends no seconds and no offset: read as UTC)."""
    if value is None:
        return None
    try:
        moment = dt.datetime.fromisoformat(value)
    except ValueError:
        raise BadRequest(f"{name} is not an ISO 8601 time (e.g. 2026-01-31T12:00)", **{name: value[:64]}) from None
    if moment.tzinfo is None:
        return moment.replace(tzinfo=dt.UTC)
    try:
        return moment.astimezone(dt.UTC)
    except OverflowError:
        raise BadRequest(f"{name} is outside the representable range of times", **{name: value[:64]}) from None


@dataclass(frozen=True)
class AuditView:
    entries: list[AuditEntry]
    next_cursor: str | None


def audit_log(
    ctx: StoreContext, claims: Claims, where: audit.AuditFilter, cursor: str | None, limit: str | None
) -> AuditView:
    """``GET /v1/audit?order=desc``: newest first, keyset-paged by id."""
    page = audit.read_page(ctx.db, claims, where, cursor, page_limit(limit, MAX_AUDIT_PAGE), newest_first=True)
    return AuditView(page.entries, page.next_cursor)


# -- tokens ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokensView:
    tokens: list[TokenInfo]
    #: Each listed token's ancestors, parent first.
    chains: dict[str, list[str]]
    next_cursor: str | None
    keys: list[KeyInfo]


def tokens(ctx: StoreContext, claims: Claims, sub: str | None, cursor: str | None, limit: str | None) -> TokensView:
    """``GET /v1/tokens`` (oldest first, never a token value) and ``cgstore keys list``."""
    is_admin(claims).enforce()
    page = ctx.tokens.list_tokens(sub, cursor=cursor, limit=page_limit(limit, MAX_TOKEN_PAGE))
    with ctx.db.session() as session:
        keys = ctx.tokens.ring.list_keys(session)
    return TokensView(page.tokens, ctx.tokens.chains(t.jti for t in page.tokens), page.next_cursor, keys)


# -- storage -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StorageView:
    storage: StorageBytes
    growth: list[blobs.DayGrowth]
    growth_chart: Markup
    #: When ``storage`` and ``growth`` were computed (``Aggregates``); the rest is read live.
    computed_at: dt.datetime
    open_uploads: int
    leases: list[leases.LeaseInfo]
    now: dt.datetime
    #: On a mirror, its upstream section (None: this store has no upstream).
    upstream: UpstreamView | None = None


@dataclass(frozen=True)
class UpstreamView:
    """A mirror's upstream as the Storage page shows it: never the upstream token, only its URL and figures."""

    status: mirror.MirrorStatus
    #: Seconds behind the upstream's events feed (``mirror.follower.sync_lag_s``); NaN before the first contact.
    sync_lag_s: float
    last_contact: dt.datetime | None
    preheat: bool
    evict_after_s: int
    follow_wait_s: int
    families: str
    sms: str


def storage(ctx: StoreContext, claims: Claims) -> StorageView:
    is_admin(claims).enforce()
    stored, growth, chart, computed_at = _storage_sums.get(ctx)
    return StorageView(
        storage=stored,
        growth=growth,
        growth_chart=chart,
        computed_at=computed_at,
        open_uploads=blobs.open_session_count(ctx),
        leases=leases.list_leases(ctx.db),
        now=utcnow(),
        upstream=upstream_view(ctx),
    )


def upstream_view(ctx: StoreContext) -> UpstreamView | None:
    """The Storage page's upstream section of a mirror (None on a store without an upstream)."""
    status = mirror.state(ctx)
    if status is None:
        return None
    settings = ctx.settings
    contact = status.last_contact
    return UpstreamView(
        status=status,
        sync_lag_s=mirror_follower.sync_lag_s(ctx),
        last_contact=dt.datetime.fromtimestamp(contact, dt.UTC) if contact is not None else None,
        preheat=settings.mirror_preheat,
        evict_after_s=settings.mirror_evict_after,
        follow_wait_s=settings.mirror_follow_wait_s,
        families=settings.mirror_families,
        sms=settings.mirror_sm,
    )


def _storage_facts(ctx: StoreContext) -> tuple[StorageBytes, list[blobs.DayGrowth], Markup, dt.datetime]:
    now = utcnow()
    first_day = (now - dt.timedelta(days=GROWTH_DAYS - 1)).date()
    with ctx.db.session() as session:
        stored = admin.storage_bytes(session)
        growth = blobs.growth_per_day(session, dt.datetime.combine(first_day, dt.time(), dt.UTC))
    by_day = {day.day: day.bytes for day in growth}
    every_day = [first_day + dt.timedelta(days=n) for n in range(GROWTH_DAYS)]  # a day with nothing is a gap
    chart = charts.growth_chart([(day.isoformat(), by_day.get(day, 0)) for day in every_day])
    return stored, growth, chart, now


_storage_sums = Aggregates(_storage_facts)


# -- why a declaration misses ------------------------------------------------------------------

#: The explain page's form fields, as typed (``release`` may be empty).
EXPLAIN_FIELDS = ("family", "sm", "envelope", "toolchain", "release")


@dataclass(frozen=True)
class ExplainView:
    """Discover's answer to the declaration for this admin's token, explained on a miss."""

    family: str
    explained: search.Explained
    #: The miss's differences described as the client's one-line detail does (``explain.describe``).
    described: list[str] = field(default_factory=list)


def explain_declaration(ctx: StoreContext, claims: Claims, typed: dict[str, str | None]) -> ExplainView | None:
    """What discover answers ``claims`` for the typed declaration (``search.explain_declaration``: one
    implementation with the API's), or None while the form is empty. A field that is not a declaration's
    (bad JSON, an envelope or toolchain admission refuses) is ``BadRequest`` naming it."""
    is_admin(claims).enforce()
    if not any(typed.get(name) for name in EXPLAIN_FIELDS):
        return None
    missing = [name for name in ("family", "sm", "envelope", "toolchain") if not typed.get(name)]
    if missing:
        raise BadRequest(f"a declaration needs {', '.join(missing)}")
    envelope = _json_field(typed, "envelope")
    toolchain = _json_field(typed, "toolchain")
    try:
        request = DiscoverRequest(
            family=typed["family"],
            sm=typed["sm"],
            envelope=envelope,
            toolchain=_toolchain_axis(toolchain),
            release=typed.get("release"),
            explain=True,
        )
        explained = search.explain_declaration(ctx, claims, request)
    except ValidationError as err:
        raise BadRequest(f"not a declaration: {_first_error(err)}") from None
    except StoreError as err:
        if not 400 <= err.status < 500:
            raise
        raise BadRequest(err.message) from None
    nearest = explained.miss.nearest if explained.miss else None
    described = [explain.describe(d) for d in nearest.differences] if nearest else []
    return ExplainView(family=request.family, explained=explained, described=described)


def _json_field(typed: dict[str, str | None], name: str) -> dict[str, Any]:
    try:
        value = json.loads(typed[name] or "")
    except json.JSONDecodeError as err:
        raise BadRequest(f"{name} is not JSON ({err.msg} at character {err.pos})") from None
    if not isinstance(value, dict):
        raise BadRequest(f"{name} must be a JSON object, not {type(value).__name__}")
    return value


def _toolchain_axis(value: dict[str, Any]) -> Any:
    """A manifest's toolchain axis (``components``, ``recorded``) as it is, or one flat mapping as a worker's
    ``Toolchain`` is: the store classifies keyed and recorded names either way (``admission.derive_axes``)."""
    if "components" in value and set(value) <= {"components", "recorded"}:
        return value
    return {"components": value, "recorded": {}}


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))


# -- the audit of console reads ------------------------------------------------------------


def record_read(
    ctx: StoreContext,
    claims: Claims,
    *,
    action: str,
    target: str,
    source: str | None,
    detail: dict[str, Any] | None = None,
) -> None:
    """One audit entry for a console page an admin read (or a sign-in), in its own transaction."""
    with ctx.db.session() as session:
        audit.record(
            session, actor=claims.sub, jti=claims.jti, action=action, target=target, source=source, detail=detail
        )
