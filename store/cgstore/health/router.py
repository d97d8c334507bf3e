"""``/healthz``, ``/readyz``, ``/metrics`` and ``/v1/capabilities``.

Only ``/metrics`` asks for a token (the metrics token, not a store token); the others are open.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Header, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from cgstore.context import StoreContext, get_context
from cgstore.core.errors import Unavailable
from cgstore.health import service

router = APIRouter(tags=["service"])


@router.get("/healthz")
async def healthz(ctx: StoreContext = Depends(get_context)) -> dict:
    """Liveness: the process answers (200 whatever else holds). A mirror says ``degraded`` while its upstream
    does not answer, it trusts no upstream keys yet, or it refused a key set; ``mirror`` says which."""
    if ctx.mirror is None:
        return {"status": "ok"}
    return await run_in_threadpool(service.mirror_health, ctx)


@router.get("/readyz", responses={503: {"description": "not ready: the failing checks say which"}})
async def readyz(response: Response, ctx: StoreContext = Depends(get_context)) -> dict:
    """Readiness: the database and the object store answer."""
    checks = await run_in_threadpool(service.readiness, ctx)
    ready = all(check == "ok" for check in checks.values())
    if not ready:
        response.status_code = 503
        response.headers["Retry-After"] = str(Unavailable.retry_after_s)
    # Decided from the checks, not read back from ``response``: FastAPI's injected
    # response has no status until one is set, so reading it back said "unavailable".
    return {"status": "ok" if ready else "unavailable", "checks": checks}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(
    ctx: StoreContext = Depends(get_context), authorization: str | None = Header(None, include_in_schema=False)
) -> Response:
    """Prometheus metrics, only to the metrics token (else 404)."""
    payload = await run_in_threadpool(service.metrics_text, ctx, authorization)
    return Response(payload, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/capabilities")
async def capabilities(ctx: StoreContext = Depends(get_context)) -> dict:
    """What this store supports: digest algorithms, key schemes, archive kinds, limits."""
    return service.capabilities(ctx)
