"""Session-wide fixtures: real PostgreSQL and S3 servers, and the store in both configurations; and how a
session in several workers is laid out (the longest files first, the archives built from its start)."""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import signal
import subprocess
import sys

import pytest

from cgstore.settings import Settings
from tests.support import archives, services
from tests.support.live_store import CONFIGURATIONS, running_store, session_servers, settings_for

pytest_plugins: list[str] = ["tests.support.archives"]

#: The suite's longest files (seconds each took in three xdist workers, 2026-12-07), handed out first: xdist
#: deals out whole files in collection order (``make test`` passes ``--no-loadscope-reorder``; its own order,
#: the most tests first, dealt these out last, and the run ended on them while other workers idled). The
#: first three need no compiled archive: the workers run them while the archives build (``pytest_configure``).
#: The other files follow, the most tests first.
RUN_FIRST = (
    "tests/operations/test_gc.py",  # 114 s
    "tests/storage/test_storage.py",  # 112
    "tests/faults/test_crashes.py",  # 99
    "tests/client/test_discover_boot.py",  # 330, of which 140 the transformers archives' compiles
    "tests/fleet/test_fleet.py",  # 309
    "tests/security/test_miss_timing.py",  # 246
    "tests/faults/test_publish_and_gc_crashes.py",  # 125
    "tests/client/test_boot.py",  # 74
    "tests/console/test_console_browser.py",  # 60
    "tests/claims/test_claims.py",  # 49
    "tests/operations/test_scrub.py",  # 46
    "tests/client/test_docs_minting.py",  # 41
    "tests/fleet/test_readme_fleet.py",  # 37
    "tests/events/test_feed.py",  # 37
    "tests/client/test_client_blobs.py",  # 36
    "tests/audit/test_chain.py",  # 36
    "tests/mirror/test_pull_through.py",  # 36
)


#: The controller's archive build, started at once when the session runs in workers (``pytest_configure``).
ARCHIVE_BUILD = pytest.StashKey[subprocess.Popen]()


def pytest_configure(config: pytest.Config) -> None:
    """In several workers, the controller starts filling the archive cache in a process of its own
    (``python -m tests.support.archives build``, its output in ``.test-cache/build.log``) before any
    worker runs. A fresh clone compiles them for a minute or more; built on demand, they were started
    only once a worker's first file needing them began, and every worker then waited for them."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    archives.CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(archives.CACHE_ROOT.parent / "build.log", "wb") as log:
        config.stash[ARCHIVE_BUILD] = subprocess.Popen(
            [sys.executable, "-m", "tests.support.archives", "build"],
            cwd=archives.REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: stopped with the mint it runs beside it
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    """A build the session never needed to finish (a few files ran) is stopped; its staging is dropped next time."""
    build = config.stash.get(ARCHIVE_BUILD, None)
    if build is not None and build.poll() is None:
        os.killpg(build.pid, signal.SIGTERM)
        build.wait(30)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Whole files in ``RUN_FIRST`` order, then the others with the most tests first (a stable sort:
    each file's own order is kept)."""
    counts = collections.Counter(item.path for item in items)
    rank = {archives.REPO / path: position for position, path in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path, len(rank)), -counts[item.path], item.path))


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


@contextlib.contextmanager
def _session_store(request, tmp_path_factory, configuration: str):
    home = tmp_path_factory.mktemp(f"home-{configuration}")
    with running_store(
        settings_for(configuration, home, **session_servers(request, configuration)), configuration
    ) as live:
        yield live


@pytest.fixture(scope="session")
def embedded_store(request, tmp_path_factory):
    """The session's embedded store (``store`` for one configuration)."""
    with _session_store(request, tmp_path_factory, "embedded") as live:
        yield live


@pytest.fixture(scope="session")
def production_store(request, tmp_path_factory, pg_url, session_bucket):
    """The session's production store (``store`` for the other), stopped before its servers."""
    with _session_store(request, tmp_path_factory, "production") as live:
        yield live


@pytest.fixture(scope="session", params=CONFIGURATIONS)
def store(request):
    """The store, running, once per configuration: every test using it runs twice.

    A file's tests run for one configuration, then the other: both stores stay up for the whole
    session (``embedded_store``, ``production_store``), as restarting one at each switch cost a second.
    """
    return request.getfixturevalue(f"{request.param}_store")


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
