"""The README's leading worker boot (``mint="on_miss"``), run as written against a live store (embedded)."""

from __future__ import annotations

import time

import pytest

from tests.support.docs import example

pytestmark = pytest.mark.torch


def test_the_readme_boot_on_miss_mints_once_and_switches_in_place(make_store, tmp_path, monkeypatch):
    live = make_store("embedded")
    monkeypatch.setenv("CGSTORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CGSTORE_URL", live.base_url)
    monkeypatch.setenv("CGSTORE_TOKEN", live.mint("w", "acme/*:read,write"))
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "readme"}
    exec(compile(example("worker-boot-on-miss") + "\n", "README.md", "exec"), scope)  # noqa: S102
    booted = scope["booted"]
    assert booted.compiled and booted.confirmation == "confirmed" and booted.loaded.repo == "acme/fleet"
    (log,) = (tmp_path / "cache" / "mints").glob("*.log")  # one mint child, its log kept
    assert "compiling claim" in log.read_text() and "published ck1-" in log.read_text()
    work = tmp_path / "cache" / "mints" / log.stem  # its work files (program, archive) go when the child exits
    deadline = time.monotonic() + 60
    while work.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not work.exists()
