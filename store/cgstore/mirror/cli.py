"""``cgstore mirror``: trust the upstream's keys at setup, show the mirror's state, print a store's fingerprint.

``trust`` is run once on the mirror's host (after ``cgstore db upgrade``,
before or while it serves): it fetches the upstream's ``GET /v1/keys`` and
records those keys as the only ones the mirror's pulled receipts may be
signed by. With ``--expect`` (the fingerprint the upstream's operator read
with ``cgstore mirror fingerprint`` on the upstream's host) it refuses any
other set: a man in the middle at setup is caught there. Audited
(``mirror.trust``, actor ``mirror``).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from cgstore.core.db import Database
from cgstore.mirror import trust
from cgstore.mirror.upstream import Upstream, UpstreamRefused, UpstreamUnavailable, read_token
from cgstore.settings import Settings


def mirror_app() -> typer.Typer:
    app = typer.Typer(help="Regional mirrors: trust the upstream's keys, show the state.", no_args_is_help=True)

    @app.command("trust")
    def trust_upstream(
        expect: Annotated[
            str | None,
            typer.Option(
                help="Refuse unless the upstream's keys have this fingerprint (`cgstore mirror fingerprint`)."
            ),
        ] = None,
    ) -> None:
        """Fetch CGSTORE_UPSTREAM_URL's keys (GET /v1/keys) and trust them for the receipts the mirror pulls."""
        settings = Settings()
        if settings.upstream_url is None:
            typer.echo("CGSTORE_UPSTREAM_URL is not set: this store is not a mirror", err=True)
            raise typer.Exit(2)
        upstream = Upstream(
            settings.upstream_url, read_token(settings.upstream_token_file), settings.upstream_timeout_s
        )
        try:
            jwks = upstream.jwks()
        except (UpstreamUnavailable, UpstreamRefused) as err:
            typer.echo(f"the upstream's keys could not be read: {err}", err=True)
            raise typer.Exit(1) from None
        finally:
            upstream.close()
        try:
            found = trust.record_trust(
                Database(settings.resolved_database_url), settings.upstream_url, jwks, expect=expect, how="cli"
            )
        except trust.TrustRefused as err:
            typer.echo(f"refused: {err}", err=True)
            raise typer.Exit(1) from None
        typer.echo(found)

    @app.command("status")
    def status() -> None:
        """The trusted upstream keys' fingerprint and any key set refused (JSON)."""
        from cgstore.mirror.models import REFUSED_KEYS, MirrorState

        settings = Settings()
        with Database(settings.resolved_database_url).session() as session:
            trusted = trust.trusted(session)
            refused = session.get(MirrorState, REFUSED_KEYS)
            document = {
                "upstream": settings.upstream_url,
                "trusted": {k: trusted[k] for k in ("fingerprint", "url", "at")} if trusted else None,
                "trusted_kids": sorted(k.get("kid", "") for k in trusted["keys"]) if trusted else [],
                "refused": refused.value if refused is not None else None,
            }
        typer.echo(json.dumps(document, indent=2))

    @app.command("fingerprint")
    def fingerprint() -> None:
        """This store's own key set's fingerprint: what a mirror's operator passes to `trust --expect`."""
        from cgstore.tokens.ring import KeyRing

        settings = Settings()
        db = Database(settings.resolved_database_url)
        with db.session() as session:
            keys = KeyRing(db, settings).jwks(session)
        typer.echo(trust.fingerprint({"keys": keys}))

    return app
