"""The walk-through's worker boot and mint-child publish (README), run as written against a live store (embedded)."""

from __future__ import annotations

import pytest

from tests.support.docs import example

pytestmark = pytest.mark.torch


def test_the_readme_boot_and_publish_run_as_written(make_store, tmp_path, monkeypatch):
    """As pasted: the client from CGSTORE_URL / CGSTORE_TOKEN (no TOKEN in scope), one toolchain, nothing left behind."""
    boot, publish = example("worker-boot") + "\n", example("mint-publish") + "\n"
    live = make_store("embedded")
    monkeypatch.setenv("CGSTORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CGSTORE_URL", live.base_url)
    monkeypatch.setenv("CGSTORE_TOKEN", live.mint("w", "acme/*:read,write"))
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "readme"}
    exec(compile(boot + publish, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    assert scope["published"].status == "created" and scope["loaded"].key == scope["key"]
    # The walk-through's own record, booted by declaration with boot's default toolchain: a hit.
    assert scope["booted"].compiled and scope["booted"].loaded.key == scope["key"]
    assert not list(tmp_path.glob("*.pt2"))  # the archive went to a temporary directory
