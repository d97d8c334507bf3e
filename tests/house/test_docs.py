"""The docs stay findable and true: generated tables current, links resolving, the README short.

``docs/generate.py`` writes the configuration, CLI and route tables from the
code; a page that differs from what the code says fails here (run ``make
docs``). Every relative link of README.md and docs/ names a file that exists
(pages moved once; links must not rot), and no file of the repository names a
path outside it: a clone must hold everything it cites. The README stays an entry page
(≤ 250 lines); the rest lives in one page per reader.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

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
def test_relative_links_resolve_inside_the_repository(page):
    targets = [(page.parent / target).resolve() for target in _LINK.findall(page.read_text())]
    assert [str(t) for t in targets if not t.is_relative_to(REPO_ROOT)] == []
    assert [str(t.relative_to(REPO_ROOT)) for t in targets if not t.exists()] == []


# A path that may leave the repository: a parent-relative one (kept only when it resolves
# outside), or an absolute one into this machine's work tree.
_OUTSIDE = re.compile(r"(?<![\w.])(?:\.\./)+[A-Za-z_][\w.-]*(?:/[\w.-]+)*|/work/\w+")


def outside_paths(path, text: str) -> list[str]:
    """The paths ``text`` (the file at ``path``) names that resolve outside the repository."""
    found = []
    for match in _OUTSIDE.finditer(text):
        named = match.group(0)
        target = Path(named) if named.startswith("/") else (path.parent / named).resolve()
        if not target.is_relative_to(REPO_ROOT):
            found.append(f"{path.relative_to(REPO_ROOT)}: {named}")
    return found


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    suffixes = {".py", ".md", ".toml", ".yml", ".yaml", ".json", ".html", ".txt", ".cfg", ".ini", ""}
    files = [REPO_ROOT / name for name in listed.stdout.splitlines()]
    return [f for f in files if f.suffix in suffixes and f.is_file() and f.stat().st_size < 2_000_000]


def test_no_file_names_a_path_outside_the_repository():
    named = [hit for f in tracked_text_files() for hit in outside_paths(f, f.read_text(errors="replace"))]
    assert named == []


def test_an_outside_path_is_found_and_an_inside_one_is_not():
    page = REPO_ROOT / "docs" / "api.md"
    sibling, work = "../" * 2 + "shared/design/PROTOCOL.md", "/" + "work/shared"  # not literal: this file is scanned
    assert outside_paths(page, f"see [it]({sibling}) and ``{work}/x``") == [
        f"docs/api.md: {sibling}",
        f"docs/api.md: {work}",
    ]
    assert outside_paths(page, "[client](client.md), ../README.md, tests/vectors/ck1.json") == []


def test_the_readme_is_an_entry_page_linking_every_reader_page():
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = set(_LINK.findall(readme))
    assert {f"docs/{page.name}" for page in (REPO_ROOT / "docs").glob("*.md")} <= linked


def test_the_readme_says_how_to_get_the_worker_side_and_what_make_test_needs():
    """``make install-worker`` pins the CPU torch (never PyPI's CUDA build); the README says what ``make test`` needs."""
    dry = subprocess.run(
        ["make", "-n", "install-worker", "VENV=/nonexistent/venv"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    torch_installs = [line for line in dry if "torch" in line and "pip install" in line]
    assert any("--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in line for line in torch_installs)
    assert all("--index-url" in line or "client[torch]" in line for line in torch_installs)
    readme = (REPO_ROOT / "README.md").read_text()
    assert "make install-worker" in readme
    tests = readme[readme.index("## Tests") : readme.index("## Walk-through")]
    for needed in ("PostgreSQL", "root", "torch==2.13.0"):
        assert needed in tests, needed
    assert re.search(r"about \d+ minutes", tests), "the README says how long make test takes"
