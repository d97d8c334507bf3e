"""The HTTP side of a mirror's one rule for writes: it takes none, and says where they go.

Mounted (``app.py``) on the routers that write: blobs, uploads, publish, yank,
drift reports, claims, repos, owners. On a mirror, any method there but a read
is answered 403 ``MIRROR_READ_ONLY`` with ``detail.upstream`` (its URL, never
its token), before the token or the body is looked at: a worker that mints
on a miss claims and publishes at the upstream (``Client(write_url=)``).
"""

from __future__ import annotations

from fastapi import Depends, Request

from cgstore.context import StoreContext, get_context
from cgstore.core.errors import MirrorReadOnly

#: The methods a mirror answers on a writing router: reads.
READS = frozenset({"GET", "HEAD", "OPTIONS"})


def refuse_writes_on_mirror(request: Request, ctx: StoreContext = Depends(get_context)) -> None:
    upstream = ctx.settings.upstream_url
    if upstream is not None and request.method not in READS:
        raise MirrorReadOnly(
            "this store is a read-only mirror: publish, upload, claim and yank at its upstream", upstream=upstream
        )
