"""Find the documentation's runnable examples by name, wherever the page that holds them lives.

A fenced block that a test executes is preceded by ``<!-- example: NAME -->`` in
``README.md`` or any page under ``docs/``; tests ask for it by NAME, so text can
move between pages without a test losing its example.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"<!-- example: (?P<name>[\w.-]+) -->\s*\n```[\w-]*\n(?P<body>.*?)\n```", re.DOTALL)


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def example(name: str) -> str:
    """The body of the one fenced block marked ``<!-- example: name -->``."""
    found = [
        (page, m.group("body"))
        for page in pages()
        if page.exists()
        for m in _BLOCK.finditer(page.read_text())
        if m.group("name") == name
    ]
    if len(found) != 1:
        where = ", ".join(str(page.relative_to(REPO_ROOT)) for page, _ in found) or "no page"
        raise LookupError(f"example {name!r} must be marked exactly once; found in {where}")
    return found[0][1]
