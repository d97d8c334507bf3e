"""The suite's own scheduling (``tests/conftest.py``): the files it deals out first are files of the suite."""

from __future__ import annotations

from tests.conftest import RUN_FIRST
from tests.support.archives import REPO


def test_every_file_dealt_out_first_is_a_test_file_of_the_suite():
    assert [path for path in RUN_FIRST if not (REPO / path).is_file()] == []
    assert len(set(RUN_FIRST)) == len(RUN_FIRST)
