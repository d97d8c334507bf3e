"""The walk-through's worker boot and mint-child publish (README), run as written against a live store (embedded)."""

from __future__ import annotations

import pytest

from tests.support.docs import example

pytestmark = pytest.mark.torch


def test_the_readme_boot_and_publish_run_as_written(make_store, tmp_path, monkeypatch):
    boot, publish = example("worker-boot") + "\n", example("mint-publish") + "\n"
    live = make_store("embedded")
    monkeypatch.setenv("CGSTORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    code = (boot + publish).replace("http://127.0.0.1:8080", live.base_url)
    scope = {"TOKEN": live.mint("w", "acme/*:read,write"), "__name__": "readme"}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    assert scope["published"].status == "created" and scope["loaded"].key == scope["key"]
