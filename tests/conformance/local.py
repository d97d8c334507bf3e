"""Local deployments for the conformance suite inside ``make test`` (the only server-aware part).

``replicas`` runs two store apps on one PostgreSQL database, one bucket and one
signing key — the shape of a multi-replica deployment behind a load balancer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tests.conformance.conftest import Deployment
from tests.support.live_store import running_store, settings_for
from tests.support.services import postgres_database

ADMIN_SUB = "conformance-admin"


@contextlib.contextmanager
def local_deployment(request, name: str) -> Iterator[Deployment]:
    configuration = "embedded" if name == "embedded" else "production"
    s3 = request.getfixturevalue("s3_server") if configuration == "production" else None
    home = request.getfixturevalue("tmp_path_factory").mktemp(f"conformance-{name}")
    replicas = 2 if name == "replicas" else 1
    with contextlib.ExitStack() as stack:
        # A database of its own: blobs are stored once per database, and this deployment
        # has its own bucket, so it must not see rows whose bytes live in another one.
        pg = stack.enter_context(postgres_database("cgstore_conformance")) if s3 else None
        settings = settings_for(configuration, home, pg_url=pg, s3=s3)
        stores = [stack.enter_context(running_store(settings, configuration)) for _ in range(replicas)]
        admin = stores[0].mint(ADMIN_SUB, "*/*:admin", ttl_s=4 * 3600, platform=True)
        yield Deployment(name, [store.base_url for store in stores], admin, local_mint=stores[0].mint)
