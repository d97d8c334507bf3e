"""Crash points: where the fault suite may SIGKILL the store, to prove crashes lose nothing.

A crash point is a named place between two effects that must not be seen
half-done (bytes stored but not linked, a chunk staged but its offset not
moved, …). ``crash_point(name)`` does nothing unless the process was started
with ``CGSTORE_CRASH_AT=<name>`` — a test-only switch read from the
environment on purpose, so that no settings file can turn it on by accident.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "CGSTORE_CRASH_AT"


def crash_point(name: str) -> None:
    """Die here, without cleanup, when the fault suite asked for this point."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
