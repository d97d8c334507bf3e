"""``cgstore ls``, ``cgstore show KEY``, ``cgstore stats``: the admin views for an operator on the store's host.

Like ``cgstore audit`` they read ``CGSTORE_DATABASE_URL`` directly, so they
keep working while the HTTP side is down. Tables for people (rich, markup off:
stored strings are shown as they are, never interpreted), and with ``--json``
one JSON object per line — the wire types of ``cgstore_client.wire.admin``
and ``wire.records``, the same objects ``GET /v1/admin/stats`` answers.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from typing import Annotated

import typer
from cgstore_client.wire.admin import DEFAULT_LS_LIMIT, AdminStats, RecordSummary
from cgstore_client.wire.audit import AuditEntry
from cgstore_client.wire.records import Record
from rich.console import Console
from rich.table import Table

from cgstore.admin import service
from cgstore.core.db import Database

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


def _table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> Table:
    table = Table(title=title, box=None, pad_edge=False, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


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
        _console().print(_summary_table(None, summaries))


def _summary_table(title: str | None, summaries: Sequence[RecordSummary]) -> Table:
    return _table(
        title, ("repo", "key", "family", "sm", "lane", "health", "drift", "publisher", "created (UTC)"),
        ((_repo_cell(s), s.key, s.family, s.sm, s.lane, s.health, str(s.drift_reports), s.publisher,
          _when(s.created_at)) for s in summaries),
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
    for record in records:
        _console().print(_record_table(record))


def _record_table(record: Record) -> Table:
    manifest = record.manifest
    rows = [
        ("repo", record.repo), ("key", record.key), ("health", record.health),
        ("family", manifest.family), ("lane", manifest.lane), ("sm", manifest.axes.sm),
        ("kind/format", f"{manifest.kind}/{manifest.format}"), ("graph", manifest.axes.graph),
        ("artifact", f"{manifest.artifact.digest}  {manifest.artifact.size} bytes"),
        *((f"component {c.name}", f"{c.digest}  {c.size} bytes") for c in manifest.components),
        ("publisher", record.publisher.principal), ("created (UTC)", _when(record.created_at)),
        ("release", record.manifest.release or "-"), ("binding signature", record.binding_signature or "-"),
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
    console = _console()
    console.print(_table(f"{facts.live_records} live records", ("family", "sm", "lane", "records"),
                         ((c.family, c.sm, c.lane, str(c.records)) for c in facts.records)))
    storage = facts.storage
    ratio = "-" if storage.dedup_ratio is None else f"{storage.dedup_ratio:.2f}x"
    console.print(_table("storage", ("blobs", "stored bytes", "referenced bytes", "logical bytes", "dedup"), [
        (str(storage.blobs), str(storage.stored_bytes), str(storage.referenced_bytes),
         str(storage.logical_bytes), ratio)]))
    console.print(_table("top publishers", ("publisher", "records"),
                         ((p.publisher, str(p.records)) for p in facts.top_publishers)))
    console.print(_entries_table("recent conflicts", facts.recent_conflicts))
    console.print(_entries_table("recent denials", facts.recent_denials))
    console.print(_summary_table(f"unhealthy records ({len(facts.unhealthy)} newest)", facts.unhealthy))
    console.print(_summary_table(f"drift reports: {facts.drift_reports} (most reported records)", facts.drifting))


def _entries_table(title: str, entries: Sequence[AuditEntry]) -> Table:
    return _table(title, ("at (UTC)", "actor", "action", "target", "outcome"),
                  ((_when(e.at), e.actor, e.action, e.target, e.outcome) for e in entries))


def _echo_json(items: Iterable) -> None:
    for item in items:
        typer.echo(item.model_dump_json())


#: The commands, as ``cgstore.cli`` registers them.
COMMANDS: dict[str, Callable[..., None]] = {"ls": ls, "show": show, "stats": stats}
