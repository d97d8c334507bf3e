"""docs/client.md "Minting": the transformers GPT-2 example runs as written (tiny config, no hub) against a live store."""

from __future__ import annotations

import pytest

from tests.support.docs import example

pytestmark = pytest.mark.torch


def test_the_docs_gpt2_mint_runs_as_written(make_store, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    live = make_store("embedded")
    monkeypatch.setenv("CGSTORE_URL", live.base_url)
    monkeypatch.setenv("CGSTORE_TOKEN", live.mint("mint-child", "acme/*:read,write"))
    monkeypatch.setenv("CGSTORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "docs"}
    exec(compile(example("mint-gpt2"), "docs/client.md", "exec"), scope)  # noqa: S102 - the docs' own code
    booted = scope["booted"]
    assert scope["published"].status == "created"
    assert booted.compiled and booted.confirmation == "confirmed" and booted.served_from == "store"
