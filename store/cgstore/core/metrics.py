"""Prometheus metrics: requests, bytes, upload sessions, publish outcomes, resolve hits and misses,
mint claims, background tasks and GC, and a mirror's following of its upstream.

Collected by a pure ASGI middleware (it never buffers a streamed body) into a
registry owned by the app, so several apps in one process don't collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: The ``family`` label of resolves whose family is not on the allow-list.
OTHER_FAMILY = "other"


class Metrics:
    def __init__(self, family_labels: frozenset[str] = frozenset()) -> None:
        # Families are caller-chosen and may name a tenant's private work, so only
        # the operator's allow-list is ever shown (which also bounds cardinality).
        self.family_labels = family_labels
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "cgstore_requests_total", "HTTP requests answered.", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "cgstore_request_seconds",
            "Time from request start to the end of the response body.",
            ["method", "route"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.bytes_in = Counter("cgstore_bytes_in_total", "Request body bytes received.", registry=self.registry)
        self.bytes_out = Counter("cgstore_bytes_out_total", "Response body bytes sent.", registry=self.registry)
        self.upload_sessions_open = Gauge(
            "cgstore_upload_sessions_open",
            "Upload sessions open (not committed, cancelled or expired).",
            registry=self.registry,
        )

        self.background_rounds = Counter(
            "cgstore_background_rounds_total",
            "Rounds of background tasks: ran here, skipped (another replica holds the lease), failed.",
            ["task", "outcome"],
            registry=self.registry,
        )
        self.gc_blobs_deleted = Counter(
            "cgstore_gc_blobs_deleted_total", "Blobs garbage collection deleted.", registry=self.registry
        )
        self.gc_bytes_deleted = Counter(
            "cgstore_gc_bytes_deleted_total", "Bytes of the blobs garbage collection deleted.", registry=self.registry
        )
        self.publishes = Counter(
            "cgstore_publish_total",
            "Compiled-graph publishes by outcome (created, exists, conflict, refused) and protocol code.",
            ["outcome", "code"],
            registry=self.registry,
        )
        self.denials = Counter(
            "cgstore_denials_total",
            "Requests refused 401 or 403, by protocol code (a hidden miss answers 404 like an absent one "
            "and is counted only in the audit log).",
            ["code"],
            registry=self.registry,
        )
        self.internal_errors = Counter(
            "cgstore_internal_errors_total",
            "Requests answered 500 INTERNAL (an unexpected failure; its traceback is in the log).",
            registry=self.registry,
        )
        self.resolve_answers = Counter(
            "cgstore_resolve_answers_total",
            "Resolve answers per family: hit or miss.",
            ["family", "status"],
            registry=self.registry,
        )
        self.claims = Counter(
            "cgstore_claims_total",
            "Mint claims by outcome: the answers (granted, held, published, backoff, failing), claims that expired "
            "(taken over), and releases (released_published, released_failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.claims_in_flight = Gauge(
            "cgstore_claims_in_flight",
            "Mint claims held and not expired (read from the database at scrape time).",
            registry=self.registry,
        )

        # A regional mirror's (docs/operations.md "Regional mirrors"); on any other store they stay 0 / NaN.
        self.mirror_upstream_up = Gauge(
            "cgstore_mirror_upstream_up",
            "On a mirror: 1 while its upstream answers, 0 while it does not (NaN: not a mirror, or not asked yet).",
            registry=self.registry,
        )
        self.mirror_pulled_bytes = Counter(
            "cgstore_mirror_pulled_bytes_total",
            "Blob bytes a mirror pulled from its upstream (verified and stored).",
            registry=self.registry,
        )
        self.mirror_pulls_refused = Counter(
            "cgstore_mirror_pulls_refused_total",
            "Records a mirror refused to store: a blob, receipt or key that failed verification.",
            registry=self.registry,
        )
        self.mirror_alarms = Counter(
            "cgstore_mirror_alarms_total",
            "Times a mirror refused a key set its upstream served that no trusted key vouches for.",
            registry=self.registry,
        )

        # Its follower (``mirror/follower.py``) and eviction (``mirror/eviction.py``); zero off a mirror.
        self.mirror_feed_events = Counter(
            "cgstore_mirror_feed_events_total",
            "Events of the upstream's record events feed a mirror applied, by kind (published, yanked).",
            ["kind"],
            registry=self.registry,
        )
        self.mirror_sync_lag = Gauge(
            "cgstore_mirror_sync_lag_seconds",
            "How far a mirror's following of its upstream's events feed is behind: 0 while a long-poll is open "
            "after catching up, else the seconds since it last was (grows through an upstream outage); NaN off a "
            "mirror or before the first contact (read from the database at scrape time).",
            registry=self.registry,
        )
        self.mirror_preheats = Counter(
            "cgstore_mirror_preheats_total",
            "Records a mirror preheated as the upstream's feed announced them, by outcome (pulled, filtered, failed).",
            ["outcome"],
            registry=self.registry,
        )
        self.mirror_resyncs = Counter(
            "cgstore_mirror_feed_resyncs_total",
            "Times a mirror's feed cursor was refused as too old and every mirrored record was re-checked upstream.",
            registry=self.registry,
        )
        self.mirror_evicted = Counter(
            "cgstore_mirror_evicted_records_total",
            "Mirrored records evicted, unused for CGSTORE_MIRROR_EVICT_AFTER (pulled again on demand).",
            registry=self.registry,
        )

    def watch_upstream(self, up: Callable[[], float]) -> None:
        """Read whether a mirror's upstream answers at scrape time (per process)."""
        self.mirror_upstream_up.set_function(up)

    def watch_mirror_lag(self, lag: Callable[[], float]) -> None:
        """Read the mirror's sync lag from the database at scrape time (whichever replica follows)."""
        self.mirror_sync_lag.set_function(lag)

    def count_resolve(self, family: str, hits: int, misses: int) -> None:
        """Hits and misses of one resolve, labelled by family only if the family is allow-listed."""
        label = family if family in self.family_labels else OTHER_FAMILY
        if hits:
            self.resolve_answers.labels(label, "hit").inc(hits)
        if misses:
            self.resolve_answers.labels(label, "miss").inc(misses)

    def watch_upload_sessions(self, count: Callable[[], int]) -> None:
        """Read the open-session count from the database at scrape time (any process may change it)."""
        self.upload_sessions_open.set_function(count)

    def watch_claims(self, count: Callable[[], float]) -> None:
        """Read the claims in flight from the database at scrape time (every replica reports the same)."""
        self.claims_in_flight.set_function(count)


class MetricsMiddleware:
    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}
        metrics = self.metrics

        async def counting_receive():
            message = await receive()
            if message["type"] == "http.request":
                metrics.bytes_in.inc(len(message.get("body", b"")))
            return message

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            elif message["type"] == "http.response.body":
                metrics.bytes_out.inc(len(message.get("body", b"")))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            route = scope.get("route")
            # The route template, not the raw path: digests and ids would explode cardinality.
            label = getattr(route, "path", "unmatched")
            metrics.requests.labels(scope["method"], label, str(status["code"])).inc()
            metrics.latency.labels(scope["method"], label).observe(time.perf_counter() - started)
