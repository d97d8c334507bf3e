"""The ``cgstore`` command: serve, migrate, tokens and the key ring, principals, uploads, GC, scrub, the audit log,
the admin views.

The token, key and principal commands work on the database directly (an
operator on the store's host); every change they make is audited with actor
``cli``, in the same transaction. They never print a private key, and print a
token only when they mint it.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Annotated

import typer

from cgstore.admin.cli import COMMANDS as ADMIN_COMMANDS
from cgstore.audit.cli import audit_app
from cgstore.claims.cli import claims_app
from cgstore.core.errors import StoreError
from cgstore.core.private import UMASK, private_dir
from cgstore.mirror.cli import mirror_app
from cgstore.settings import MiB, Settings
from cgstore_client.wire.tokens import MAX_TOKEN_PAGE

app = typer.Typer(help="cgstore: the registry for PyTorch compiled graphs.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
token_app = typer.Typer(help="Cap-tokens.", no_args_is_help=True)
keys_app = typer.Typer(help="The signing-key ring: rotate, retire, list.", no_args_is_help=True)
principal_app = typer.Typer(help="Principals: platform or tenant.", no_args_is_help=True)
uploads_app = typer.Typer(help="Resumable upload sessions.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")
app.add_typer(keys_app, name="keys")
app.add_typer(principal_app, name="principal")
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
    from cgstore.core.serving import limit_malloc_arenas, server_options

    settings = Settings()
    limit_malloc_arenas(settings.malloc_arenas)
    private_dir(settings.home)
    url = settings.resolved_database_url
    if migrate if migrate is not None else url.startswith("sqlite"):
        migrations.upgrade(url)
    elif not migrations.is_current(url):
        typer.echo("the database schema is not current: run `cgstore db upgrade` first", err=True)
        raise typer.Exit(2)
    logging.basicConfig(level=settings.log_level.upper())
    options = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "timeout_graceful_shutdown": 10,
        **server_options(settings),
    }
    if settings.workers == 1:
        uvicorn.run(create_app(settings), **options)
    else:
        # One event loop holds the GIL for every request's Python work: more
        # processes are how a resolve-heavy store uses more than one core. uvicorn
        # starts each by import, so each builds its own app (pool, reaper, denial
        # log, metrics) from the same CGSTORE_* environment.
        uvicorn.run("cgstore.app:create_app", factory=True, workers=settings.workers, **options)


@db_app.command("upgrade")
def db_upgrade(
    revision: str = "head",
    wait: Annotated[
        str, typer.Option(help="Retry connecting this long first (90s, 2m) while the database starts.")
    ] = "0s",
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


def _token_service():
    """A token service on the configured database (an embedded SQLite one is migrated first)."""
    from cgstore.core import migrate as migrations
    from cgstore.core.db import Database
    from cgstore.tokens.service import TokenService

    settings = Settings()
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        migrations.upgrade(url)
    return TokenService(Database(url), settings)


def _fail(err: StoreError) -> typer.Exit:
    typer.echo(f"error: {err.code}: {err.message}", err=True)
    return typer.Exit(2)


@token_app.command("mint")
def token_mint(
    sub: Annotated[str, typer.Option(help="The principal the token speaks for.")],
    grant: Annotated[list[str], typer.Option(help="'owner/glob:action,action' (repeatable).")],
    ttl: Annotated[str, typer.Option(help="Lifetime: 90s, 15m, 1h, 7d.")] = "1h",
    platform: Annotated[bool, typer.Option(help="A platform token; registers SUB as a platform principal.")] = False,
) -> None:
    """Print a token signed with the ring's current key (and, on stderr, the CGSTORE_HOME it came from)."""
    _say_where()
    try:
        minted = _token_service().mint(sub, grant, parse_duration(ttl), platform=platform)
    except StoreError as err:
        raise _fail(err) from None
    typer.echo(minted.token)


def _say_where() -> None:
    """Name the state the CLI uses: run from another directory, ``./.cgstore`` is another store's key and database."""
    settings = Settings()
    home = settings.home.resolve()
    if settings.database_url is not None:
        where = "the database of CGSTORE_DATABASE_URL"
    elif (home / "cgstore.sqlite3").exists():
        where = f"CGSTORE_HOME={home}"
    else:
        where = f"CGSTORE_HOME={home} (new here: a server started elsewhere will not know its key)"
    typer.echo(f"cgstore: using {where}", err=True)


@token_app.command("list")
def token_list(sub: Annotated[str | None, typer.Option(help="Only this principal's tokens.")] = None) -> None:
    """Every recorded token: jti, sub, status, expiry, parent, grants (never the token)."""
    tokens, cursor = _token_service(), None
    while True:  # page by page, so a large table is never held at once
        page = tokens.list_tokens(sub, cursor=cursor, limit=MAX_TOKEN_PAGE)
        for info in page.tokens:
            grants = " ".join(f"{g['repo']}:{','.join(g['actions'])}" for g in info.grants)
            typer.echo(
                f"{info.jti}  {info.sub}  {info.status}  exp={info.expires_at.isoformat()}  "
                f"parent={info.parent_jti or '-'}  plt={str(info.platform).lower()}  {grants}"
            )
        if page.next_cursor is None:
            return
        cursor = page.next_cursor


@token_app.command("revoke")
def token_revoke(jti: str) -> None:
    """Revoke JTI and every token attenuated from it."""
    try:
        count = _token_service().revoke(jti)
    except StoreError as err:
        raise _fail(err) from None
    typer.echo(f"revoked {count} tokens")


@principal_app.command("set")
def principal_set(
    name: str,
    platform: Annotated[bool, typer.Option("--platform/--tenant", help="Register as platform, or demote to tenant.")],
) -> None:
    """Register NAME as a platform principal, or demote it to a tenant (root writes stop at once)."""
    from cgstore.owners.service import register_principal

    service = _token_service()
    try:
        register_principal(service.db, name, platform)
    except StoreError as err:
        raise _fail(err) from None
    typer.echo(f"{name}: {'platform' if platform else 'tenant'}")


@keys_app.command("rotate")
def keys_rotate() -> None:
    """Add a new signing key (it signs from now on); older keys keep verifying until retired."""
    from cgstore.audit.service import record

    service = _token_service()
    with service.db.session() as session:
        kid = service.ring.rotate(session)
        record(session, actor="cli", jti=None, action="key.rotate", target=kid)
    typer.echo(kid)


@keys_app.command("retire")
def keys_retire(kid: str) -> None:
    """Stop accepting KID and re-sign its receipts with the current key (again on a retired KID: any left).

    The publish receipts KID signed are re-signed with the current key in the same
    transaction: records stay verifiable against ``GET /v1/keys``. Run again on a
    retired KID, it re-signs any receipt still signed by it.
    """
    import cgstore.models  # noqa: F401  (every table: the records' foreign keys must resolve)
    from cgstore.audit.service import record
    from cgstore.compiled_graphs.receipts import retire

    service = _token_service()
    try:
        with service.db.session() as session:
            changed, resigned = retire(session, service.ring, issuer=Settings().token_issuer, kid=kid)
            if changed or resigned:
                record(
                    session,
                    actor="cli",
                    jti=None,
                    action="key.retire",
                    target=kid,
                    detail={"receipts_resigned": resigned},
                )
    except StoreError as err:
        raise _fail(err) from None
    if changed:
        typer.echo(f"retired {kid}")
    else:
        typer.echo(
            f"{kid} was already retired" + (f"; re-signed {resigned} receipts it still held" if resigned else "")
        )


@keys_app.command("list")
def keys_list() -> None:
    """The ring: kid, created, retired, and whether this host holds its private half."""
    service = _token_service()
    with service.db.session() as session:
        keys = service.ring.list_keys(session)
    for key in keys:
        retired = key.retired_at.isoformat() if key.retired_at else "-"
        typer.echo(f"{key.kid}  created={key.created_at.isoformat()}  retired={retired}  signs_here={key.signs_here}")


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
    grace: Annotated[
        str | None, typer.Option(help="Keep blobs linked more recently than this (default CGSTORE_GC_GRACE_S).")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(min=1, max=10_000, help="Blobs per batch (default CGSTORE_GC_BATCH_SIZE).")
    ] = None,
) -> None:
    """Delete blobs nothing keeps, reap expired upload sessions and drop staged uploads no session names;
    one line per blob, a JSON summary last."""
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
    for session_id in report.staged:
        typer.echo(f"{'would drop' if dry_run else 'dropped'} staged upload {session_id} (no session)")
    typer.echo(json.dumps(report.summary()))


@app.command()
def scrub(
    repo: Annotated[str | None, typer.Option(help="Only the blobs linked into owner/repo.")] = None,
    sample: Annotated[
        int | None, typer.Option(min=1, help="Check N blobs picked at random (the cursor stays).")
    ] = None,
    rate: Annotated[float | None, typer.Option(min=0.001, help="Read at most this many MiB/s.")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the last interrupted pass from its cursor.")] = False,
) -> None:
    """Re-hash stored blobs; name each missing or corrupt one and take its records out of resolve.

    Exit status 1 when it found damage, 2 on an error (the store unreachable, another
    instance scrubbing: one scrub at a time runs, under the ``scrub`` lease).
    """
    from cgstore.app import build_context
    from cgstore.operations import leases
    from cgstore.operations.scrub import scrub as run_scrub

    if sample is not None and resume:
        raise typer.BadParameter("--sample checks a random set; it has no cursor to --resume")
    ctx = build_context(Settings())
    lease = leases.acquire(ctx.db, leases.SCRUB, ctx.instance, ctx.settings.lease_ttl_s)
    if lease is None:
        typer.echo("another instance is scrubbing now (it holds the scrub lease)", err=True)
        raise typer.Exit(2)
    try:
        report = run_scrub(
            ctx,
            repo=repo,
            sample=sample,
            resume=resume,
            rate_bytes_s=rate * MiB if rate else None,
            heartbeat=lease.renew,
        )
    except StoreError as err:
        raise _fail(err) from None
    except leases.LeaseLost:
        typer.echo("the scrub lease was taken over; resume with --resume", err=True)
        raise typer.Exit(2) from None
    finally:
        lease.release()
    for finding in report.damaged:
        typer.echo(f"{finding.health} {finding.digest}  records_changed={finding.records_changed}")
    for finding in report.healed:
        typer.echo(f"healed {finding.digest}  records_changed={finding.records_changed}")
    pass_state = "complete" if report.complete else "sample"  # an interrupted pass raised above
    typer.echo(
        f"scrub {report.scope}: {report.checked} blobs checked, {report.bytes_read} bytes read, "
        f"{len(report.damaged)} damaged, {len(report.healed)} healed ({pass_state})"
    )
    if report.damaged:
        raise typer.Exit(1)


app.add_typer(audit_app(parse_duration), name="audit")
app.add_typer(claims_app(), name="claims")
app.add_typer(mirror_app(), name="mirror")
for _name, _command in ADMIN_COMMANDS.items():
    app.command(_name)(_command)


if __name__ == "__main__":
    app()
