"""``cgstore claims``: the mints in flight and the failing declarations, and clearing one, on the store's host.

Reads ``CGSTORE_DATABASE_URL`` directly (as ``cgstore audit`` does), so an
operator can clear a failing declaration while the HTTP side is down. A
clear is audited (``compiled_graph.claim.clear``, actor ``cli``) like the
console's.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from cgstore.claims import service
from cgstore.core.db import Database
from cgstore.core.errors import NameUnknown

#: Rows ``cgstore claims list`` prints per table.
LIST_ROWS = 1000


def _database() -> Database:
    from cgstore.settings import Settings

    return Database(Settings().resolved_database_url)


def _line(view: service.SlotView) -> dict:
    return {key: value.isoformat() if hasattr(value, "isoformat") else value for key, value in vars(view).items()}


def claims_app() -> typer.Typer:
    app = typer.Typer(help="Mint claims: what is being minted, what keeps failing.", no_args_is_help=True)

    @app.command("list")
    def list_claims(
        failing: Annotated[bool, typer.Option("--failing", help="Only the failing declarations.")] = False,
    ) -> None:
        """Mints in flight and failing declarations, one JSON object per line (`id` is what `clear` takes)."""
        db = _database()
        try:
            with db.session() as session:
                views = [] if failing else service.in_flight(session, LIST_ROWS)
                views += service.failing(session, LIST_ROWS)
        finally:
            db.dispose()
        for view in views:
            typer.echo(json.dumps(_line(view), sort_keys=True))

    @app.command("clear")
    def clear(
        slot: Annotated[int, typer.Argument(metavar="ID", help="The declaration's id (from `cgstore claims list`).")],
    ) -> None:
        """Clear a failing declaration (and any backoff): the next claim of it is granted."""
        db = _database()
        try:
            view = service.clear(db, slot, actor="cli", jti=None)
        except NameUnknown as err:
            typer.echo(f"error: {err.message}", err=True)
            raise typer.Exit(1) from None
        finally:
            db.dispose()
        typer.echo(f"cleared {view.repo} {view.family} {view.sm} release={view.release or '-'}")

    return app
