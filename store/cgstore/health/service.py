"""What the operational endpoints report."""

from __future__ import annotations

import logging

from prometheus_client import generate_latest

from cgstore import access
from cgstore.context import StoreContext
from cgstore.core.errors import NameUnknown, StoreError
from cgstore.mirror import service as mirror
from cgstore_client.wire.records import MAX_RESOLVE_KEYS

log = logging.getLogger(__name__)


def metrics_text(ctx: StoreContext, authorization: str | None) -> bytes:
    """The Prometheus exposition, for the metrics token only; anyone else gets an unknown path's 404."""
    configured = ctx.settings.metrics_token
    if not access.can_scrape_metrics(authorization, configured.get_secret_value() if configured else None):
        raise NameUnknown("Not Found")
    return generate_latest(ctx.metrics.registry)


def mirror_health(ctx: StoreContext) -> dict:
    """``/healthz`` of a mirror: its upstream asked if not heard from lately (bounded), then its state."""
    mirror.probe(ctx)
    status = mirror.state(ctx)
    assert status is not None
    return {
        "status": "degraded" if status.degraded else "ok",
        "mirror": {
            "upstream": status.upstream,
            "reachable": status.reachable,
            "last_contact": status.last_contact,
            "trusted_fingerprint": status.trusted_fingerprint,
            "alarm": status.alarm,
        },
    }


def readiness(ctx: StoreContext) -> dict[str, str]:
    """``ok`` or a short reason, per dependency."""
    return {"database": _check(ctx.db.ping), "storage": _check(ctx.storage.ping)}


def _check(ping) -> str:
    try:
        ping()
    except StoreError as err:  # its message is written for clients: what failed, never where
        log.warning("readiness check failed: %s", err)
        return f"unavailable: {err.message}"
    except Exception as err:  # any failure means "not ready"; the reason is reported, not raised
        log.warning("readiness check failed: %s", err)
        return f"unavailable: {type(err).__name__}"
    return "ok"


def capabilities(ctx: StoreContext) -> dict:
    return {
        "digest_algorithms": ["blake3"],
        "key_schemes": ["ck1"],
        "accepted_kinds": ["aot-inductor"],
        "retired_kinds": ["torch-inductor-cache"],
        "max_blob_bytes": ctx.settings.max_blob_bytes,
        "max_resolve_keys": MAX_RESOLVE_KEYS,
        "redirect_downloads": bool(ctx.settings.redirect_downloads and ctx.storage.supports_presign),
    }
