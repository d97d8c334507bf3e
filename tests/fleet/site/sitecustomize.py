"""Installs the fleet tests' compile memo (``tests/fleet/memo.py``) in a worker and its mint children."""

import os

if os.environ.get("FLEET_COMPILE_MEMO"):
    from tests.fleet import memo

    memo.install()
