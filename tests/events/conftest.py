"""Fixtures of the events feed tests: publications of archive A, and replicas of one registry."""

from __future__ import annotations

import pytest

from tests.compiled_graphs.support import CONSTANTS_A, publication, safetensors_bytes, unique_envelope
from tests.operations.conftest import replica_settings, replicas  # noqa: F401 (fixtures)
from tests.support.archives import archive_report


@pytest.fixture
def publications(pt2_archive):
    """``make(family=..., **fields)``: a publication of archive A under an envelope (a key) no other test uses."""
    report = archive_report(pt2_archive)
    components = {"consts": safetensors_bytes(CONSTANTS_A)}

    def make(**fields):
        return publication(pt2_archive, report, components=components, envelope=unique_envelope(), **fields)

    return make
