"""Fixtures of the regional mirror tests: an upstream store and mirrors of it (docs/deploy.md "Regional mirrors").

``upstream``: one per session, PostgreSQL (its own database) + RGW (its own
bucket), its app behind a ``Tap`` that counts what it served; publishing there
uses the session's one small real archive (``tests/support/archives.py``).
``mirror``: a mirror in each configuration (module-scoped, so each test file
gets a cold one), reaching the upstream through a ``CuttableProxy``, its
upstream token in a 0600 file, the upstream's keys trusted. ``make_mirror``
starts more (``make_mirror("embedded", mirror_families="flux-*")``).
"""

from __future__ import annotations

import contextlib
import os
import secrets

import pytest

from cgstore.settings import Settings
from tests.mirror.support import OWNER, MirrorStore, UpstreamStore, tapped_store, trust_upstream
from tests.support import services
from tests.support.archives import archive_report
from tests.support.live_store import CONFIGURATIONS, running_store
from tests.support.proxy import CuttableProxy

#: How long a test waits on an upstream that does not answer: short, so outage tests stay fast.
UPSTREAM_TIMEOUT_S = 2.0


@pytest.fixture(scope="session")
def upstream(request, tmp_path_factory, s3_server, pt2_archive):
    """The upstream: PostgreSQL + RGW, blob bytes streamed by the store itself (so the tap counts them)."""
    with contextlib.ExitStack() as stack:
        services.use_s3_credentials(s3_server)
        settings = Settings(
            home=tmp_path_factory.mktemp("upstream"),
            database_url=stack.enter_context(services.postgres_database("cgstore_upstream")),
            storage_url=s3_server.storage_url(s3_server.create_bucket()),
            redirect_downloads=False,
            reaper_interval_s=3600,
            metrics_token=secrets.token_urlsafe(24),
            console_aggregates_s=0,
            events_poll_s=0.1,
        )
        live, tap = stack.enter_context(tapped_store(settings, "production"))
        store = UpstreamStore(live=live, tap=tap, archive=pt2_archive, report=archive_report(pt2_archive))
        store.admin = live.mint("upstream-admin", "*/*:admin")
        store.publisher = live.mint("publisher", f"{OWNER}/*:read,write")
        yield store


def _start_mirror(
    stack, request, tmp_path_factory, upstream: UpstreamStore, configuration: str, via: str | None = None, **overrides
):
    """A mirror of ``upstream`` reached through a ``CuttableProxy`` (or at ``via``, e.g. a ``HostileProxy``)."""
    home = tmp_path_factory.mktemp(f"mirror-{configuration}")
    proxy = CuttableProxy(int(upstream.base_url.rsplit(":", 1)[1]))
    stack.callback(proxy.close)
    upstream_token = upstream.live.mint(f"mirror-{configuration}", f"{OWNER}/*:read")
    token_file = home / "upstream-token"
    token_file.write_text(upstream_token + "\n")
    os.chmod(token_file, 0o600)
    overrides.setdefault("upstream_timeout_s", UPSTREAM_TIMEOUT_S)
    overrides.setdefault("mirror_negative_ttl_s", 1.0)
    settings_fields = dict(
        home=home,
        upstream_url=via or f"http://127.0.0.1:{proxy.port}",
        upstream_token_file=token_file,
        reaper_interval_s=3600,
        metrics_token=secrets.token_urlsafe(24),
        console_aggregates_s=0,
        **overrides,
    )
    if configuration == "production":
        s3 = request.getfixturevalue("s3_server")
        services.use_s3_credentials(s3)
        settings_fields["database_url"] = stack.enter_context(services.postgres_database("cgstore_mirror"))
        settings_fields["storage_url"] = s3.storage_url(s3.create_bucket())
    live = stack.enter_context(running_store(Settings(**settings_fields), configuration))
    trust_upstream(live, upstream.base_url)
    mirror = MirrorStore(live=live, proxy=proxy, upstream_token=upstream_token)
    mirror.worker = live.mint("worker", f"{OWNER}/*:read")
    return mirror


@pytest.fixture(scope="module", params=CONFIGURATIONS)
def mirror(request, tmp_path_factory, upstream):
    """A cold mirror of ``upstream`` in each configuration, for one test module."""
    with contextlib.ExitStack() as stack:
        yield _start_mirror(stack, request, tmp_path_factory, upstream, request.param)


@pytest.fixture
def make_mirror(request, tmp_path_factory, upstream):
    """Start another mirror of ``upstream``: ``make_mirror("embedded", mirror_families="flux-*")``;
    ``via=url``: reach the upstream at that URL (a proxy of it)."""
    with contextlib.ExitStack() as stack:
        yield lambda configuration, via=None, **overrides: _start_mirror(
            stack, request, tmp_path_factory, upstream, configuration, via, **overrides
        )
