"""The docs stay findable and true: generated tables current, links resolving, the README short.

``docs/generate.py`` writes the configuration, CLI and route tables from the
code; a page that differs from what the code says fails here (run ``make
docs``). Every relative link of README.md and docs/ names a file that exists
(pages moved once; links must not rot; links out of the repository are
not checked). The README stays an entry page
(≤ 250 lines); the rest lives in one page per reader.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.support.docs import REPO_ROOT, pages

_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)#\s]+)(?:#[^)]*)?\)")


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("docs_generate", REPO_ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_match_the_code(generate):
    assert generate.stale() == []


def test_a_table_that_drifted_is_named(generate, tmp_path):
    for page in ("deploy.md", "operations.md", "api.md"):
        (tmp_path / page).write_text((REPO_ROOT / "docs" / page).read_text())
    deploy = tmp_path / "deploy.md"
    deploy.write_text(deploy.read_text().replace("| listen port |", "| the port, maybe |"))
    assert generate.stale(tmp_path) == ["deploy.md: settings"]
    generate.write(tmp_path)
    assert generate.stale(tmp_path) == []


def test_a_page_without_its_block_is_an_error(generate):
    with pytest.raises(LookupError):
        generate.render("# no block here\n", "settings", "| table |")


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_resolve(page):
    # Links leaving the repository (the shared design documents) are not the repository's to keep.
    targets = [(page.parent / target).resolve() for target in _LINK.findall(page.read_text())]
    inside = [target for target in targets if target.is_relative_to(REPO_ROOT)]
    assert [str(t.relative_to(REPO_ROOT)) for t in inside if not t.exists()] == []


def test_the_readme_is_an_entry_page_linking_every_reader_page():
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = set(_LINK.findall(readme))
    assert {f"docs/{page.name}" for page in (REPO_ROOT / "docs").glob("*.md")} <= linked


def test_the_readme_says_how_to_get_the_worker_side_and_what_make_test_needs():
    """``make install-worker`` pins the CPU torch (never PyPI's CUDA build); the README says what ``make test`` needs."""
    import subprocess

    dry = subprocess.run(["make", "-n", "install-worker", "VENV=/nonexistent/venv"], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    torch_installs = [line for line in dry if "torch" in line and "pip install" in line]
    assert any("--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in line for line in torch_installs)
    assert all("--index-url" in line or "client[torch]" in line for line in torch_installs)
    readme = (REPO_ROOT / "README.md").read_text()
    assert "make install-worker" in readme
    tests = readme[readme.index("## Tests"):readme.index("## Walk-through")]
    for needed in ("PostgreSQL", "root", "torch==2.13.0", "17 minutes"):
        assert needed in tests, needed
