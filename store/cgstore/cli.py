"""The ``cgstore`` command: serve, migrate, mint tokens, reclaim abandoned uploads."""

from __future__ import annotations

import logging
import os
import re
from typing import Annotated

import typer

from cgstore.core.errors import StoreError
from cgstore.core.private import UMASK, private_dir
from cgstore.settings import Settings

app = typer.Typer(help="cgstore: the registry for PyTorch compiled graphs.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
token_app = typer.Typer(help="Cap-tokens.", no_args_is_help=True)
uploads_app = typer.Typer(help="Resumable upload sessions.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")
app.add_typer(uploads_app, name="uploads")

@app.callback()
def _private_by_default() -> None:
    """Every command creates state private to the service user (files libraries create included)."""
    os.umask(UMASK)


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
    from cgstore.core.serving import server_options

    settings = Settings()
    private_dir(settings.home)
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
        **server_options(settings),
    )


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Migrate CGSTORE_DATABASE_URL to ``revision`` (default: the newest)."""
    from cgstore.core import migrate as migrations

    settings = Settings()
    migrations.upgrade(settings.resolved_database_url, revision)
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
    from cgstore.blobs.service import reap_expired_sessions

    typer.echo(f"reaped {reap_expired_sessions(build_context(Settings()))} sessions")


if __name__ == "__main__":
    app()
