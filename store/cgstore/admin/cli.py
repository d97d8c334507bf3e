"""``cgstore ls``, ``cgstore show KEY``, ``cgstore stats``: the admin views for an operator on the store's host.

Like ``cgstore audit`` they read ``CGSTORE_DATABASE_URL`` directly, so they
keep working while the HTTP side is down. Tables for people on a terminal
(rich, markup off: stored strings are shown as they are, never interpreted);
piped, plain tab-separated columns (a header line, ``# title`` lines, one row
per line, never folded to a terminal width); and with ``--json`` one JSON object per line — the wire types of ``cgstore_client.wire.admin``
and ``wire.records``, the same objects ``GET /v1/admin/stats`` answers.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from cgstore.admin import service
from cgstore.core.db import Database
from cgstore_client.wire.admin import DEFAULT_LS_LIMIT, AdminStats, RecordSummary
from cgstore_client.wire.audit import AuditEntry
from cgstore_client.wire.records import Record

JsonFlag = Annotated[bool, typer.Option("--json", help="One JSON object per line.")]


@contextmanager
def _session():
    from cgstore.settings import Settings

    db = Database(Settings().resolved_database_url)
    try:
        with db.session() as session:
            yield session
    finally:
        db.dispose()


def _console() -> Console:
    return Console(markup=False, highlight=False)


@dataclass(frozen=True)
class _Grid:
    """A titled table's columns and rows, printed by :func:`_print` for a terminal or a pipe."""

    title: str | None
    columns: Sequence[str]
    rows: list[Sequence[str]]


def _table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> _Grid:
    return _Grid(title, columns, [list(row) for row in rows])


def _print(*grids: _Grid) -> None:
    """Rich tables on a terminal; piped (``cgstore ls | …``), plain tab-separated lines: rich would fold every
    cell to 80 columns."""
    if sys.stdout.isatty():
        console = _console()
        for grid in grids:
            console.print(_rich(grid))
        return
    for grid in grids:
        if grid.title:
            typer.echo(f"# {_plain(grid.title)}")
        for row in (grid.columns, *grid.rows):
            typer.echo("\t".join(_plain(cell) for cell in row))


def _rich(grid: _Grid) -> Table:
    table = Table(title=grid.title, box=None, pad_edge=False, title_justify="left")
    for column in grid.columns:
        table.add_column(column, overflow="fold")
    for row in grid.rows:
        table.add_row(*row)
    return table


def _plain(cell: str) -> str:
    # One line per row, one tab per column: a stored string cannot add either.
    return cell.replace("\t", " ").replace("\n", " ").replace("\r", " ")


def _when(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def ls(
    family: Annotated[str | None, typer.Option(help="Only records of this family.")] = None,
    sm: Annotated[str | None, typer.Option(help="Only records for this GPU architecture or CPU ISA.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="How many of the newest to show.")] = DEFAULT_LS_LIMIT,
    json_lines: JsonFlag = False,
) -> None:
    """List live compiled-graph records in every repo, newest first."""
    with _session() as session:
        summaries = service.list_records(session, family=family, sm=sm, limit=limit)
    if json_lines:
        _echo_json(summaries)
    elif not summaries:
        typer.echo("no matching records")
    else:
        _print(_summary_table(None, summaries))


def _summary_table(title: str | None, summaries: Sequence[RecordSummary]) -> _Grid:
    return _table(
        title,
        ("repo", "key", "family", "sm", "lane", "health", "drift", "publisher", "created (UTC)"),
        (
            (
                _repo_cell(s),
                s.key,
                s.family,
                s.sm,
                s.lane,
                s.health,
                str(s.drift_reports),
                s.publisher,
                _when(s.created_at),
            )
            for s in summaries
        ),
    )


def _repo_cell(summary: RecordSummary) -> str:
    """The repo, marked when it is a private cache (the JSON API shows such a record to its publisher only)."""
    return f"{summary.repo} (private)" if summary.private else summary.repo


def show(
    key: Annotated[str, typer.Argument(help="The ck1 key.")],
    json_lines: JsonFlag = False,
) -> None:
    """Show the live record of KEY in every repo holding one (exit status 1: none)."""
    with _session() as session:
        records = service.show(session, key)
    if not records:
        typer.echo(f"no live record has the key {key!r}", err=True)
        raise typer.Exit(1)
    if json_lines:
        _echo_json(records)
        return
    _print(*(_record_table(record) for record in records))


def _record_table(record: Record) -> _Grid:
    manifest = record.manifest
    rows = [
        ("repo", record.repo),
        ("key", record.key),
        ("health", record.health),
        ("family", manifest.family),
        ("lane", manifest.lane),
        ("sm", manifest.axes.sm),
        ("kind/format", f"{manifest.kind}/{manifest.format}"),
        ("graph", manifest.axes.graph),
        ("artifact", f"{manifest.artifact.digest}  {manifest.artifact.size} bytes"),
        *((f"component {c.name}", f"{c.digest}  {c.size} bytes") for c in manifest.components),
        ("publisher", record.publisher.principal),
        ("created (UTC)", _when(record.created_at)),
        ("release", record.manifest.release or "-"),
        ("binding signature", record.binding_signature or "-"),
        ("drift reports", str(record.drift_reports)),
    ]
    return _table(None, ("field", "value"), rows)


def stats(json_lines: JsonFlag = False) -> None:
    """Records per family, sm and lane; bytes and dedup; top publishers; recent conflicts, denials, unhealthy."""
    with _session() as session:
        facts = service.stats(session)
    if json_lines:
        typer.echo(facts.model_dump_json())
        return
    _print_stats(facts)


def _print_stats(facts: AdminStats) -> None:
    storage = facts.storage
    ratio = "-" if storage.dedup_ratio is None else f"{storage.dedup_ratio:.2f}x"
    _print(
        _table(
            f"{facts.live_records} live records",
            ("family", "sm", "lane", "records"),
            ((c.family, c.sm, c.lane, str(c.records)) for c in facts.records),
        ),
        _table(
            "storage",
            ("blobs", "stored bytes", "referenced bytes", "logical bytes", "dedup"),
            [
                (
                    str(storage.blobs),
                    str(storage.stored_bytes),
                    str(storage.referenced_bytes),
                    str(storage.logical_bytes),
                    ratio,
                )
            ],
        ),
        _table(
            "top publishers", ("publisher", "records"), ((p.publisher, str(p.records)) for p in facts.top_publishers)
        ),
        _entries_table("recent conflicts", facts.recent_conflicts),
        _entries_table("recent denials", facts.recent_denials),
        _summary_table(f"unhealthy records ({len(facts.unhealthy)} newest)", facts.unhealthy),
        _summary_table(f"drift reports: {facts.drift_reports} (most reported records)", facts.drifting),
    )


def _entries_table(title: str, entries: Sequence[AuditEntry]) -> _Grid:
    return _table(
        title,
        ("at (UTC)", "actor", "action", "target", "outcome"),
        ((_when(e.at), e.actor, e.action, e.target, e.outcome) for e in entries),
    )


def _echo_json(items: Iterable) -> None:
    for item in items:
        typer.echo(item.model_dump_json())


#: The commands, as ``cgstore.cli`` registers them.
COMMANDS: dict[str, Callable[..., None]] = {"ls": ls, "show": show, "stats": stats}
