"""``cgstore audit``: the audit log for an operator, read straight from the database.

Like the other admin commands (``cgstore token mint``) it talks to
``CGSTORE_DATABASE_URL`` directly, with the service's own settings: whoever
can run it on the store's host can read the database anyway, and it keeps
working while the HTTP side is down or flooded. (Remote admins use
``GET /v1/audit`` with a ``*/*:admin`` token; the JSON lines printed here are
exactly that endpoint's entries.)

Without ``--follow`` it prints the newest ``--limit`` matching entries, oldest
first; ``--follow`` then keeps polling for newer ones until interrupted.

``cgstore audit verify`` recomputes the digest chain and checks every signed
checkpoint (``audit.chain``): exit 0 with a summary line, or 1 naming the
first broken entry. ``cgstore audit checkpoint`` signs the chain head now
(the server does it every ``CGSTORE_AUDIT_CHECKPOINT_INTERVAL_S``).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from cgstore_client.wire.audit import MAX_AUDIT_PAGE, AuditEntry
from rich.console import Console
from rich.table import Table

from cgstore.audit import chain, service
from cgstore.core.db import Database, utcnow


def parse_moment(text: str, parse_duration) -> dt.datetime:
    """An ISO 8601 time (UTC unless it says otherwise), or a duration ago: ``15m``, ``2h``, ``7d``."""
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        return utcnow() - dt.timedelta(seconds=parse_duration(text))
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)


def audit_app(parse_duration) -> typer.Typer:
    """``cgstore audit`` (the listing) and its ``verify`` and ``checkpoint`` subcommands."""
    app = typer.Typer(help="The audit log: list it, verify its chain, sign its head.")
    app.callback(invoke_without_command=True)(_listing(parse_duration))
    app.command("verify")(verify)
    app.command("checkpoint")(checkpoint)
    return app


def _listing(parse_duration):
    """The listing command, built around the CLI's shared duration parser."""

    def moment(text: str | None) -> dt.datetime | None:
        return None if text is None else parse_moment(text, parse_duration)

    def audit(
        context: typer.Context,
        actor: Annotated[str | None, typer.Option(help="Only entries by this principal ('-': no valid token).")] = None,
        jti: Annotated[str | None, typer.Option(help="Only entries made with this token id.")] = None,
        repo: Annotated[str | None, typer.Option(help="Only entries about owner/repo.")] = None,
        action: Annotated[str | None, typer.Option(help="Exact action, or a prefix ending in '*' (token.*).")] = None,
        target: Annotated[str | None, typer.Option(help="Exact target, or a prefix ending in '*' (acme/models@*).")] = None,
        outcome: Annotated[str | None, typer.Option(help="ok, or an error code (DENIED, TOKEN_INVALID, ...).")] = None,
        source: Annotated[str | None, typer.Option(help="Only entries from this client address.")] = None,
        since: Annotated[str | None, typer.Option(help="ISO time or a duration ago (15m, 2h, 7d).")] = None,
        until: Annotated[str | None, typer.Option(help="ISO time or a duration ago.")] = None,
        limit: Annotated[int, typer.Option(min=1, max=MAX_AUDIT_PAGE, help="How many of the newest to show.")] = 50,
        json_lines: Annotated[bool, typer.Option("--json", help="One JSON object per line (GET /v1/audit's entries).")] = False,
        follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new entries until Ctrl-C.")] = False,
        interval: Annotated[float, typer.Option(min=0.05, help="Seconds between polls with --follow.")] = 2.0,
    ) -> None:
        """Show the audit log: every mutation and every denial, filtered."""
        if context.invoked_subcommand is not None:
            return

        where = service.AuditFilter(
            actor=actor, jti=jti, repo=repo, action=action, target=target, outcome=outcome, source=source,
            since=moment(since), until=moment(until),
        )
        db = _database()
        show = _print_json if json_lines else _print_table
        try:
            with db.session() as session:
                newest, _ = service.list_events(session, where, limit=limit, newest_first=True)
                entries = [service.to_entry(event) for event in reversed(newest)]
            show(entries, header=True)
            last = entries[-1].id if entries else _last_id(db)
            while follow:
                time.sleep(interval)
                last = _print_newer(db, where, last, show)
        except KeyboardInterrupt:
            pass
        finally:
            db.dispose()

    return audit


def verify(
    since: Annotated[int | None, typer.Option(min=1, help="Start at this entry (it must chain to the one before).")] = None,
    keys: Annotated[Path | None, typer.Option(
        exists=True, dir_okay=False,
        help="Trust only this JWKS (GET /v1/keys, kept outside the database) for checkpoints, not the key table.",
    )] = None,
) -> None:
    """Recompute the audit chain and check its signed checkpoints; exit 1 naming the first broken entry."""
    trusted = {} if keys is None else {"public_keys": chain.jwks_public_keys(_read_jwks(keys))}
    db = _database()
    try:
        with db.session() as session:
            report = chain.verify(session, since=since, **trusted)
    finally:
        db.dispose()
    typer.echo(report.summary(), err=report.broken is not None)
    if report.broken is not None:
        raise typer.Exit(1)


def _read_jwks(path: Path) -> dict:
    try:
        jwks = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise typer.BadParameter(f"{path}: not a readable JWKS ({err})", param_hint="--keys") from None
    if not isinstance(jwks, dict) or not isinstance(jwks.get("keys"), list):
        raise typer.BadParameter(f'{path}: not a JWKS (an object with a "keys" list)', param_hint="--keys")
    return jwks


def checkpoint() -> None:
    """Sign the audit chain's head now with the key ring's current key."""
    from cgstore.settings import Settings
    from cgstore.tokens.ring import KeyRing

    settings = Settings()
    db = _database()
    try:
        with db.session() as session:
            signed = chain.checkpoint(session, KeyRing(db, settings), issuer=settings.token_issuer)
    finally:
        db.dispose()
    typer.echo(f"signed entry {signed.audit_id} ({signed.digest})" if signed else "nothing new to sign")


def _database() -> Database:
    from cgstore.settings import Settings

    return Database(Settings().resolved_database_url)


def _last_id(db: Database) -> int:
    """Where following starts when nothing matched yet: after everything already logged."""
    with db.session() as session:
        events, _ = service.list_events(session, service.AuditFilter(), limit=1, newest_first=True)
    return events[0].id if events else 0


def _print_newer(db: Database, where: service.AuditFilter, last: int, show) -> int:
    while True:
        with db.session() as session:
            events, more = service.list_events(session, where, after=last, limit=MAX_AUDIT_PAGE)
            entries = [service.to_entry(event) for event in events]
        if entries:
            show(entries, header=False)
            last = entries[-1].id
        if more is None:
            return last


def _print_json(entries: Sequence[AuditEntry], header: bool) -> None:
    for entry in entries:
        typer.echo(entry.model_dump_json())


def _print_table(entries: Sequence[AuditEntry], header: bool) -> None:
    if not entries:
        if header:
            typer.echo("no matching audit entries")
        return
    table = Table(show_header=header, box=None, pad_edge=False)
    for column in ("id", "at (UTC)", "actor", "action", "target", "outcome", "source", "count"):
        table.add_column(column, overflow="fold")
    for entry in entries:
        table.add_row(
            str(entry.id),
            entry.at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S"),
            entry.actor,
            entry.action,
            entry.target,
            entry.outcome,
            entry.source or "",
            str(entry.count),
            style=None if entry.outcome == "ok" else "red",
        )
    # markup off: stored strings are shown as they are, never interpreted.
    Console(markup=False, highlight=False).print(table)
