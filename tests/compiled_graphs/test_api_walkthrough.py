"""The API page's compiled-graph walk-through (docs/api.md), run literally with bash and curl against ``cgstore serve``.

Only two substitutions: the store's address (a free port instead of 8080), and
the mint step, which copies the session's cached archive of the same model
instead of compiling it again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.support.docs import example
from tests.support.services import REPO_ROOT, free_port, stop_process, wait_for_port

MINT_STEP = ".venv/bin/python -m tests.support.archives mint model.pt2"


def walkthrough() -> str:
    return example("api-walkthrough") + "\n"


@pytest.fixture
def served(tmp_path):
    port = free_port()
    env = {**os.environ, "CGSTORE_HOME": str(tmp_path / "home"), "CGSTORE_PORT": str(port)}
    for name in ("CGSTORE_DATABASE_URL", "CGSTORE_STORAGE_URL"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "cgstore.cli", "serve"], env=env, cwd=tmp_path)
    try:
        wait_for_port(port, proc=proc)
        yield port, env, tmp_path
    finally:
        stop_process(proc)


def test_the_readme_walkthrough_publishes_resolves_and_yanks(served, pt2_archive):
    port, env, workdir = served
    script = walkthrough()
    assert MINT_STEP in script
    shutil.copy(pt2_archive, workdir / "cached.pt2")
    script = script.replace(MINT_STEP, "cp cached.pt2 model.pt2").replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    # Every curl prints its answer on a line of its own, with the status code.
    script = script.replace("curl -sS ", "curl -sS -w '\\n%{http_code}\\n' ")
    (workdir / ".venv").symlink_to(REPO_ROOT / ".venv")
    (workdir / "tests").symlink_to(REPO_ROOT / "tests")
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    codes = [line for line in lines if re.fullmatch(r"\d{3}", line)]
    assert codes == ["201", "201", "201", "200", "200", "200", "200", "200"], done.stdout
    bodies = [json.loads(line) for line in lines if line.startswith("{")]
    created, exists, resolved, record, listing, yanked = bodies
    assert (created["status"], exists["status"]) == ("created", "exists")
    assert [a["status"] for a in resolved["answers"]] == ["hit", "miss"]
    assert record["binding_table"] and record["publisher"]["principal"] == "minter"
    assert [r["key"] for r in listing["records"]] == [record["key"]]
    assert yanked["yank"]["reason"] == "demo"
