"""Write the reference parts of the docs from the code, so they cannot drift.

Three tables are generated, each between ``<!-- generated: NAME -->`` and
``<!-- /generated: NAME -->`` in a page under ``docs/``:

- ``settings`` (``deploy.md``): every field of ``cgstore.settings.Settings``,
  its variable, default and description (the field's own documentation);
- ``cli`` (``operations.md``): every command of the ``cgstore`` typer app and
  its help line;
- ``routes`` (``api.md``): every operation of the app's ``/openapi.json``.

``python docs/generate.py`` rewrites the pages; ``--check`` writes nothing and
exits 1 naming each table that differs (``make docs`` and
``tests/house/test_docs.py`` run it).
"""

from __future__ import annotations

import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

DOCS = Path(__file__).resolve().parent


def _default(field) -> str:
    shown = (field.json_schema_extra or {}).get("shown")
    value = field.default
    if shown is not None:
        return f"`{shown}`"
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = f"`{value}`"
    if isinstance(value, int) and value >= 1 << 30 and value % (1 << 30) == 0:
        text += f" ({value >> 30} GiB)"
    return text


def settings_table() -> str:
    from cgstore.core.migrate import MIGRATIONS_DIR_ENV
    from cgstore.settings import Settings

    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        rows.append(f"| `CGSTORE_{name.upper()}` | {_default(field)} | {field.description} |")
    rows.append(
        f"| `{MIGRATIONS_DIR_ENV}` | `<repo>/migrations` | where Alembic revisions live, "
        "for installs outside the repository (read by `cgstore db upgrade`) |"
    )
    return "\n".join(rows)


def _usage(command) -> str:
    """``ARG [--flag] [--option METAVAR]`` of a click command, as its ``--help`` spells them."""
    parts = []
    for param in command.params:
        if param.param_type_name == "argument":
            shown = param.metavar or param.name.upper()
            parts.append(shown if param.required else f"[{shown}]")
        elif not param.hidden:
            name = "/".join(param.opts + list(getattr(param, "secondary_opts", [])))
            shown = name if param.is_flag else f"{name} {param.metavar or param.name.upper()}"
            parts.append(shown if param.required else f"[{shown}]")
    return " ".join(parts)


def _commands(group, prefix: str):
    for name, command in sorted(group.commands.items()):
        path = f"{prefix} {name}"
        if getattr(command, "commands", None):
            if command.params:  # a group that also runs on its own (``cgstore audit`` lists)
                yield f"{path} {_usage(command)}", (command.help or "").strip().split("\n")[0]
            yield from _commands(command, path)
        else:
            yield f"{path} {_usage(command)}".strip(), (command.help or "").strip().split("\n")[0]


def cli_table() -> str:
    import typer

    from cgstore.cli import app

    rows = ["| command | what it does |", "|---|---|"]
    for usage, help_line in _commands(typer.main.get_command(app), "cgstore"):
        rows.append(f"| `{usage}` | {help_line} |".replace("|/", "\\|/"))
    return "\n".join(rows)


def _first_line(operation: dict) -> str:
    """The route's docstring's first line (FastAPI's ``description``), else its summary."""
    lines = (operation.get("description") or "").strip().splitlines()
    return (lines[0] if lines else operation.get("summary", "")).replace("|", "\\|")


def routes_table() -> str:
    from cgstore.app import create_app
    from cgstore.settings import Settings

    # The app opens its embedded database and key ring when built: a scratch home, thrown away.
    with tempfile.TemporaryDirectory() as home:
        schema = create_app(Settings(home=Path(home), database_url=None, storage_url=None)).openapi()
    rows = ["| method | path | what it does |", "|---|---|---|"]
    for path, operations in sorted(schema["paths"].items()):
        for method, operation in operations.items():
            rows.append(f"| `{method.upper()}` | `{path}` | {_first_line(operation)} |")
    return "\n".join(rows)


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "settings": ("deploy.md", settings_table),
    "cli": ("operations.md", cli_table),
    "routes": ("api.md", routes_table),
}


def render(page_text: str, name: str, table: str) -> str:
    """``page_text`` with the block ``name`` replaced by ``table``; LookupError when it has no such block."""
    pattern = re.compile(rf"(<!-- generated: {name} -->\n)(?:.*?\n)?(<!-- /generated: {name} -->)", re.DOTALL)
    if not pattern.search(page_text):
        raise LookupError(f"no <!-- generated: {name} --> block")
    return pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), page_text, count=1)


def stale(docs: Path = DOCS) -> list[str]:
    """The tables whose page differs from what the code says, as ``page: name``."""
    found = []
    for name, (page, build) in TABLES.items():
        text = (docs / page).read_text()
        if render(text, name, build()) != text:
            found.append(f"{page}: {name}")
    return found


def write(docs: Path = DOCS) -> None:
    for name, (page, build) in TABLES.items():
        path = docs / page
        path.write_text(render(path.read_text(), name, build()))


def main(argv: list[str]) -> int:
    if "--check" in argv:
        differing = stale()
        for entry in differing:
            print(f"stale generated table: {entry} (run `make docs`)", file=sys.stderr)
        return 1 if differing else 0
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
