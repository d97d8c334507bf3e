"""The ``cgstore`` command: serve, migrate, mint tokens, reclaim abandoned uploads, collect garbage."""

from __future__ import annotations

import logging
import re
from typing import Annotated

import typer

from cgstore.core.errors import StoreError
from cgstore.settings import Settings

app = typer.Typer(help="cgstore: the registry for PyTorch compiled graphs.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
token_app = typer.Typer(help="Cap-tokens.", no_args_is_help=True)
uploads_app = typer.Typer(help="Resumable upload sessions.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")
app.add_typer(uploads_app, name="uploads")

_DURATION = re.compile(r"(\d+)([smhd]?)", re.ASCII)
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """``90``, ``90s``, ``15m``, ``1h``, ``7d`` → seconds."""
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise typer.BadParameter(f"{text!r} is not a duration like 90s, 15m, 1h or 7d")
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


@app.command()
def serve(
    migrate: Annotated[bool, typer.Option(help="Upgrade the database first (default: only for SQLite).")] = None,
) -> None:
    """Run the store (default: embedded SQLite + local directory under CGSTORE_HOME)."""
    import uvicorn

    from cgstore.app import create_app
    from cgstore.core import migrate as migrations

    settings = Settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url
    if migrate if migrate is not None else url.startswith("sqlite"):
        migrations.upgrade(url)
    elif not migrations.is_current(url):
        typer.echo("the database schema is not current: run `cgstore db upgrade` first", err=True)
        raise typer.Exit(2)
    logging.basicConfig(level=settings.log_level.upper())
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=10,
    )


@db_app.command("upgrade")
def db_upgrade(
    revision: str = "head",
    wait: Annotated[str, typer.Option(help="Retry connecting this long first (90s, 2m) while the database starts.")] = "0s",
) -> None:
    """Migrate CGSTORE_DATABASE_URL to ``revision`` (default: the newest)."""
    from sqlalchemy.exc import OperationalError

    from cgstore.core import migrate as migrations

    settings = Settings()
    url = settings.resolved_database_url
    try:
        migrations.wait_for_database(url, parse_duration(wait))
    except OperationalError as err:
        typer.echo(f"error: the database did not answer within {wait}: {err.orig}", err=True)
        raise typer.Exit(2) from None
    migrations.upgrade(url, revision)
    typer.echo(f"database at {revision}")


@token_app.command("mint")
def token_mint(
    sub: Annotated[str, typer.Option(help="The principal the token speaks for.")],
    grant: Annotated[list[str], typer.Option(help="'owner/glob:action,action' (repeatable).")],
    ttl: Annotated[str, typer.Option(help="Lifetime: 90s, 15m, 1h, 7d.")] = "1h",
    platform: Annotated[bool, typer.Option(help="A platform token; registers SUB as a platform principal.")] = False,
) -> None:
    """Print a token signed with the configured key."""
    from cgstore.core import migrate as migrations
    from cgstore.core.db import Database
    from cgstore.tokens.service import TokenService

    settings = Settings()
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        migrations.upgrade(url)
    try:
        minted = TokenService(Database(url), settings).mint(sub, grant, parse_duration(ttl), platform=platform)
    except StoreError as err:
        typer.echo(f"error: {err.code}: {err.message}", err=True)
        raise typer.Exit(2) from None
    typer.echo(minted.token)


@uploads_app.command("reap")
def uploads_reap() -> None:
    """Reclaim the bytes of expired upload sessions now (the server also does it periodically)."""
    from cgstore.app import build_context
    from cgstore.operations import leases
    from cgstore.operations import service as operations

    reaped = operations.run_once(build_context(Settings()), leases.UPLOAD_REAPER, operations.reap_sessions)
    if reaped is None:
        typer.echo("another instance is reaping now (it holds the upload-reaper lease)", err=True)
        raise typer.Exit(1)
    typer.echo(f"reaped {reaped} sessions")


@app.command("gc")
def gc_command(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be deleted; delete nothing.")] = False,
    grace: Annotated[str | None, typer.Option(help="Keep blobs linked more recently than this (default CGSTORE_GC_GRACE_S).")] = None,
    batch_size: Annotated[int | None, typer.Option(min=1, max=10_000, help="Blobs per batch (default CGSTORE_GC_BATCH_SIZE).")] = None,
) -> None:
    """Delete blobs nothing keeps and reap expired upload sessions; one line per blob, a JSON summary last."""
    import json

    from cgstore.app import build_context
    from cgstore.operations import gc, leases

    ctx = build_context(Settings())
    options = {"grace_s": None if grace is None else parse_duration(grace), "batch_size": batch_size}
    if dry_run:  # reads only: needs no lease, disturbs no running collection
        report = gc.collect(ctx, dry_run=True, **options)
    else:
        lease = leases.acquire(ctx.db, leases.GC, ctx.instance, ctx.settings.lease_ttl_s)
        if lease is None:
            typer.echo("another instance is collecting now (it holds the gc lease)", err=True)
            raise typer.Exit(1)
        try:
            report = gc.collect(ctx, lease=lease, **options)
        finally:
            lease.release()
    verb = "would delete" if dry_run else "deleted"
    for digest in report.blobs:
        typer.echo(f"{verb} {digest}")
    for session_id in report.sessions:
        typer.echo(f"would reap upload session {session_id}")
    typer.echo(json.dumps(report.summary()))


if __name__ == "__main__":
    app()
