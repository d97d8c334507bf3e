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
import secrets

import pytest

from cgstore.settings import Settings
from tests.mirror.support import OWNER, UpstreamStore, start_mirror, tapped_store
from tests.support import services
from tests.support.archives import archive_report
from tests.support.live_store import CONFIGURATIONS


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


@pytest.fixture(scope="module", params=CONFIGURATIONS)
def mirror(request, tmp_path_factory, upstream):
    """A cold mirror of ``upstream`` in each configuration, for one test module."""
    with contextlib.ExitStack() as stack:
        yield start_mirror(stack, request, tmp_path_factory, upstream, request.param)


@pytest.fixture
def make_mirror(request, tmp_path_factory, upstream):
    """Start another mirror of ``upstream``: ``make_mirror("embedded", mirror_families="flux-*")``;
    ``via=url``: reach the upstream at that URL (a proxy of it)."""
    with contextlib.ExitStack() as stack:
        yield lambda configuration, via=None, **overrides: start_mirror(
            stack, request, tmp_path_factory, upstream, configuration, via, **overrides
        )
