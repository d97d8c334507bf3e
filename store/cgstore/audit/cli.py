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
(the server does it every ``CGSTORE_AUDIT_CHECKPOINT_INTERVAL_S``); with
``--save FILE`` it also writes the newest checkpoint there, to be kept outside
the database, and ``verify --since-checkpoint FILE`` later fails unless the
log still extends it (a transparency log's consistency check: the tail cannot
be cut back behind a checkpoint someone kept).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import jwt
import typer
from rich.console import Console
from rich.table import Table

from cgstore.audit import chain, service
from cgstore.core.db import Database, utcnow
from cgstore_client.wire.audit import MAX_AUDIT_PAGE, AuditEntry


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
        target: Annotated[
            str | None, typer.Option(help="Exact target, or a prefix ending in '*' (acme/models@*).")
        ] = None,
        outcome: Annotated[str | None, typer.Option(help="ok, or an error code (DENIED, TOKEN_INVALID, ...).")] = None,
        source: Annotated[str | None, typer.Option(help="Only entries from this client address.")] = None,
        since: Annotated[str | None, typer.Option(help="ISO time or a duration ago (15m, 2h, 7d).")] = None,
        until: Annotated[str | None, typer.Option(help="ISO time or a duration ago.")] = None,
        limit: Annotated[int, typer.Option(min=1, max=MAX_AUDIT_PAGE, help="How many of the newest to show.")] = 50,
        json_lines: Annotated[
            bool, typer.Option("--json", help="One JSON object per line (GET /v1/audit's entries).")
        ] = False,
        follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new entries until Ctrl-C.")] = False,
        interval: Annotated[float, typer.Option(min=0.05, help="Seconds between polls with --follow.")] = 2.0,
    ) -> None:
        """Show the audit log: every mutation and every denial, filtered."""
        if context.invoked_subcommand is not None:
            return

        where = service.AuditFilter(
            actor=actor,
            jti=jti,
            repo=repo,
            action=action,
            target=target,
            outcome=outcome,
            source=source,
            since=moment(since),
            until=moment(until),
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
    since: Annotated[
        int | None, typer.Option(min=1, help="Start at this entry (it must chain to the one before).")
    ] = None,
    keys: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="Trust only this JWKS (GET /v1/keys, kept outside the database) for checkpoints, not the key table.",
        ),
    ] = None,
    since_checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--since-checkpoint",
            exists=True,
            dir_okay=False,
            help="A checkpoint saved earlier (checkpoint --save): fail unless today's log extends it.",
        ),
    ] = None,
) -> None:
    """Recompute the audit chain and check its signed checkpoints; exit 1 naming the first broken entry."""
    pinned = None if keys is None else _read_jwks(keys)
    trusted = {} if pinned is None else {"public_keys": chain.jwks_public_keys(pinned)}
    saved = None if since_checkpoint is None else _read_saved(since_checkpoint, pinned)
    db = _database()
    try:
        with db.session() as session:
            report = chain.verify(session, since=since, saved=saved, **trusted)
    finally:
        db.dispose()
    typer.echo(report.summary(), err=report.broken is not None)
    if report.broken is not None:
        raise typer.Exit(1)


def _read_json(path: Path, option: str) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise typer.BadParameter(f"{path}: not readable JSON ({err})", param_hint=option) from None


def _read_jwks(path: Path) -> dict:
    jwks = _read_json(path, "--keys")
    if not isinstance(jwks, dict) or not isinstance(jwks.get("keys"), list):
        raise typer.BadParameter(f'{path}: not a JWKS (an object with a "keys" list)', param_hint="--keys")
    try:
        chain.jwks_keys(jwks)
    except (jwt.PyJWTError, TypeError, AttributeError) as err:
        raise typer.BadParameter(f"{path}: a key is not an Ed25519 JWK ({err})", param_hint="--keys") from None
    return jwks


def _read_saved(path: Path, pinned: dict | None) -> chain.SavedCheckpoint:
    """The saved checkpoint, its signature checked against ``--keys`` when given, else against the file's JWK."""
    try:
        return chain.load_saved(
            _read_json(path, "--since-checkpoint"), None if pinned is None else chain.jwks_keys(pinned)
        )
    except chain.SavedCheckpointError as err:
        raise typer.BadParameter(f"{path}: {err}", param_hint="--since-checkpoint") from None


def checkpoint(
    save: Annotated[
        Path | None,
        typer.Option(
            dir_okay=False,
            help="Also write the newest signed checkpoint to this file (verify --since-checkpoint).",
        ),
    ] = None,
    keys: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="With --save: the checkpoint must verify against this JWKS, not the key table.",
        ),
    ] = None,
) -> None:
    """Sign the audit chain's head now with the key ring's current key (and save the newest checkpoint)."""
    from cgstore.settings import Settings
    from cgstore.tokens.ring import KeyRing

    settings = Settings()
    trusted = {} if keys is None else {"public_keys": chain.jwks_public_keys(_read_jwks(keys))}
    db = _database()
    try:
        with db.session() as session:
            signed = chain.checkpoint(session, KeyRing(db, settings), issuer=settings.token_issuer)
        typer.echo(f"signed entry {signed.audit_id} ({signed.digest})" if signed else "nothing new to sign")
        if save is not None:
            _save(db, save, trusted)
    finally:
        db.dispose()


def _save(db: Database, path: Path, trusted: dict) -> None:
    """Write the newest checkpoint to ``path`` (via a temporary file, so a reader never sees half of it)."""
    try:
        with db.session() as session:
            document = chain.saved_document(session, **trusted)
    except chain.SavedCheckpointError as err:
        typer.echo(f"not saved: {err}", err=True)
        raise typer.Exit(1) from None
    if document is None:
        typer.echo("not saved: no checkpoint signed yet (nothing is chained)", err=True)
        raise typer.Exit(1)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=2) + "\n")
    partial.replace(path)
    typer.echo(f"saved the checkpoint of entry {document['audit_id']} to {path}")


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
