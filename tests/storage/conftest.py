"""Fixtures of the store's tests (session-wide ones live in tests/conftest.py)."""

# -- storage backends (tests/support/storage_fixtures.py) ----------------------------
from tests.support.storage_fixtures import make_storage_case, storage_case  # noqa: F401
# -- end of storage backends ------------------------------------------------------------
