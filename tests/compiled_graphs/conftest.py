"""Fixtures of the compiled-graph API tests."""

from __future__ import annotations

import pytest

from tests.compiled_graphs.support import CONSTANTS_A, safetensors_bytes
from tests.support.archives import archive_report


@pytest.fixture(scope="session")
def constants_a() -> bytes:
    """A safetensors component binding archive A's two constants the checkpoint does not hold."""
    return safetensors_bytes(CONSTANTS_A)


@pytest.fixture
def report_a(pt2_archive):
    return archive_report(pt2_archive)
