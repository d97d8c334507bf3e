"""Fixtures of the claims tests: the compiled-graph tests' archive A and its component."""

from __future__ import annotations

from tests.compiled_graphs.conftest import constants_a, report_a  # noqa: F401
