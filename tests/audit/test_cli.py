"""``cgstore audit``: a table for people, JSON lines for tools, ``--follow`` to tail (both configurations)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
from typer.testing import CliRunner

from cgstore.audit.service import record
from cgstore.cli import app
from cgstore_client.wire.audit import AuditEntry
from tests.support.live_store import unique_repo
from tests.support.services import REPO_ROOT


def _env(store) -> dict[str, str]:
    return {
        "CGSTORE_HOME": str(store.settings.home),
        "CGSTORE_DATABASE_URL": store.settings.resolved_database_url,
        "COLUMNS": "250",  # rich folds cells to the terminal width
    }


def _write(store, repo: str, action: str, outcome: str = "ok", actor: str = "cli-tester") -> None:
    with store.context.db.session() as session:
        record(session, actor=actor, jti=None, action=action, target=f"{repo}@x", repo=repo, outcome=outcome)


def _run(store, *args: str):
    result = CliRunner().invoke(app, ["audit", *args], env=_env(store))
    assert result.exit_code == 0, result.output
    return result.output


def test_json_lines_are_the_api_entries_newest_limit_oldest_first(store):
    repo = f"acme/{unique_repo('cli')}"
    for i in range(4):
        _write(store, repo, f"test.step{i}")
    lines = _run(store, "--repo", repo, "--json", "--limit", "3").splitlines()
    entries = [AuditEntry.model_validate_json(line) for line in lines]
    assert [e.action for e in entries] == ["test.step1", "test.step2", "test.step3"]
    assert _run(store, "--repo", repo, "--json", "--action", "test.step0").count("\n") == 1


def test_table_shows_entries_and_never_interprets_them(store):
    repo = f"acme/{unique_repo('table')}"
    _write(store, repo, "test.table", outcome="DENIED", actor="[bold]eve\x00[/bold]")
    output = _run(store, "--repo", repo, "--since", "1h")
    assert "test.table" in output and "DENIED" in output
    assert "[bold]eve\\x00[/bold]" in output  # rich markup in stored text is shown literally, NUL escaped
    assert "no matching audit entries" in _run(store, "--repo", repo, "--until", "2000-01-01T00:00:00")


def test_follow_prints_new_entries_as_they_come(store):
    repo = f"acme/{unique_repo('follow')}"
    _write(store, repo, "test.before")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cgstore.cli", "audit", "--repo", repo, "--json", "--follow", "--interval", "0.1"],
        env={**os.environ, **_env(store)},
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        assert json.loads(lines.get(timeout=30))["action"] == "test.before"
        for i in range(3):
            _write(store, repo, f"test.after{i}")
            _write(store, f"acme/{unique_repo('other')}", "test.elsewhere")  # filtered out
        got = [json.loads(lines.get(timeout=10))["action"] for _ in range(3)]
        assert got == ["test.after0", "test.after1", "test.after2"]
        time.sleep(0.3)
        assert lines.empty()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("bad", [["--since", "soon"], ["--limit", "0"]])
def test_bad_options_are_refused(store, bad):
    result = CliRunner().invoke(app, ["audit", *bad], env=_env(store))
    assert result.exit_code == 2
