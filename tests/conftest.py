"""Session-wide fixtures: real PostgreSQL and S3 servers, and the store in both configurations."""

from __future__ import annotations

import contextlib
import secrets

import pytest

from cgstore.settings import Settings
from tests.support import services
from tests.support.live_store import CONFIGURATIONS, running_store, session_servers, settings_for

pytest_plugins: list[str] = ["tests.support.archives"]


@pytest.fixture(scope="session")
def s3_server():
    """One S3 for the whole session: Ceph's RADOS Gateway on a single-host cluster (a
    database and its stores share one bucket). Its user's keys are this process's
    ``AWS_*`` variables, which stores in it and the processes it starts sign with."""
    with services.rgw_s3_server() as server:
        services.use_s3_credentials(server)
        yield server


@pytest.fixture(scope="session")
def pg_url():
    """A fresh PostgreSQL database for this session, dropped at the end."""
    with services.postgres_database() as url:
        yield url


@pytest.fixture(scope="session")
def session_bucket(s3_server) -> str:
    """The bucket of the session database's stores (the session store's and ``make_store``'s)."""
    return s3_server.create_bucket()


@pytest.fixture(scope="session", params=CONFIGURATIONS)
def store(request, tmp_path_factory):
    """The store, running, once per configuration: every test using it runs twice."""
    configuration = request.param
    home = tmp_path_factory.mktemp(f"home-{configuration}")
    with running_store(
        settings_for(configuration, home, **session_servers(request, configuration)), configuration
    ) as live:
        yield live


@pytest.fixture
def make_store(request, tmp_path_factory):
    """Start an extra store with setting overrides: ``make_store("production", upload_session_ttl_s=1)``.

    Production stores share the session database and its bucket, which is fine: tests use
    unique repo names.
    """
    stack = []

    def start(configuration: str, **overrides):
        home = tmp_path_factory.mktemp(f"extra-{configuration}")
        servers = session_servers(request, configuration)
        manager = running_store(settings_for(configuration, home, **servers, **overrides), configuration)
        stack.append(manager)
        return manager.__enter__()

    yield start
    for manager in reversed(stack):
        manager.__exit__(None, None, None)


@pytest.fixture
def make_registry(request, tmp_path_factory):
    """Start a store on a registry no other test shares (a fresh SQLite file and directory,
    or a fresh PostgreSQL database and bucket), with setting overrides:
    ``make_registry("production", scrub_interval_s=0.2)``. For tasks that read every row
    (GC, the periodic scrub): on the session database they would meet other stores' blobs.
    """
    with contextlib.ExitStack() as stack:

        def start(configuration: str, **overrides):
            overrides.setdefault("reaper_interval_s", 3600)
            overrides.setdefault("metrics_token", secrets.token_urlsafe(24))
            home = tmp_path_factory.mktemp(f"registry-{configuration}")
            if configuration == "production":
                s3 = request.getfixturevalue("s3_server")
                services.use_s3_credentials(s3)
                overrides["database_url"] = stack.enter_context(services.postgres_database("cgstore_own"))
                overrides["storage_url"] = s3.storage_url(s3.create_bucket())
            return stack.enter_context(running_store(Settings(home=home, **overrides), configuration))

        yield start
