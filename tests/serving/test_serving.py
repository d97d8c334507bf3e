"""How ``cgstore serve`` sets up its process: the glibc malloc arena cap (``CGSTORE_MALLOC_ARENAS``), and the
startup heap kept out of the garbage collector's full collections while the app serves.

Arenas are counted from glibc's own ``malloc_info`` report in a fresh
subprocess whose threads each allocate at once (each new thread that finds
no free arena gets a new one, up to the cap).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

from tests.support.live_store import running_store, settings_for
from tests.support.services import REPO_ROOT

_PROBE = r"""
import ctypes, json, sys, tempfile, threading
from cgstore.core.serving import limit_malloc_arenas

capped = limit_malloc_arenas(int(sys.argv[1]))
barrier = threading.Barrier(16)
kept = []

def allocate():
    barrier.wait()  # all at once: every thread wants an arena at the same moment
    kept.append([bytearray(100_000) for _ in range(20)])  # below the mmap threshold: arena memory
    barrier.wait()

threads = [threading.Thread(target=allocate) for _ in range(16)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile(suffix=".xml") as report:
    stream = libc.fopen(report.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    heaps = open(report.name).read().count("<heap nr=")
print(json.dumps({"capped": capped, "heaps": heaps}))
"""


def _probe(arenas: int, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(arenas)],
        env=environment,
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_cap_bounds_the_arenas_threads_get():
    assert _probe(2) == {"capped": True, "heaps": 2}


def test_zero_leaves_glibcs_default_of_an_arena_per_thread():
    uncapped = _probe(0)
    assert not uncapped["capped"] and uncapped["heaps"] > 2


def test_an_explicit_malloc_arena_max_wins():
    assert _probe(2, MALLOC_ARENA_MAX="3") == {"capped": False, "heaps": 3}


def test_the_startup_heap_is_frozen_while_serving_and_thawed_when_the_app_stops(tmp_path):
    with running_store(settings_for("embedded", tmp_path, pg_url=None, s3=None), "embedded"):
        assert gc.get_freeze_count() > 10_000  # the modules, mappers, templates and app, at least
    assert gc.get_freeze_count() == 0
