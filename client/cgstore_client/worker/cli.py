"""``cgstore-client``: the worker client from a shell.

Every command takes ``--json`` (one JSON document on stdout, nothing else);
transfers show progress bars only when stderr is a terminal. Configuration is
the client's: ``--url``/``--token``/``--cache-dir``/``--offline`` or the
``CGSTORE_*`` environment variables. Exit status: 0 done, 1 refused or failed
(``error: <protocol code, or the error's kind>: <message>``), 2 usage.

What the client does, the CLI does: ``publish`` reads the sm from the archive
(``--sm`` only to insist), ``discover --explain`` says why a declaration
misses, ``inspect ARCHIVE`` prints what the store will read off it (key, sm,
input contract, binding table), without a store.
"""

from __future__ import annotations

import json
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from cgstore_client.errors import CgstoreError
from cgstore_client.worker.client import Client
from cgstore_client.worker.outcomes import Eager, Loaded, Want

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="The cgstore worker client: resolve, discover, fetch, load, inspect, publish, preflight, verify, cache.",
)
cache_app = typer.Typer(no_args_is_help=True, help="Inspect and prune the local cache.")
app.add_typer(cache_app, name="cache")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of text.")]
_options: dict[str, Any] = {}


@app.callback()
def configure(
    url: Annotated[str | None, typer.Option(help="Store URL (CGSTORE_URL).")] = None,
    token: Annotated[str | None, typer.Option(help="Cap-token (CGSTORE_TOKEN / CGSTORE_TOKEN_FILE).")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Cache directory (CGSTORE_CACHE_DIR).")] = None,
    offline: Annotated[bool | None, typer.Option("--offline/--online", help="Never contact the store.")] = None,
) -> None:
    _options.update(url=url, token=token, cache_dir=cache_dir, offline=offline)


def _client() -> Client:
    return Client(
        _options.get("url"), _options.get("token"), cache_dir=_options.get("cache_dir"), offline=_options.get("offline")
    )


def _emit(as_json: bool, document: Any, lines: list[str]) -> None:
    if as_json:
        typer.echo(json.dumps(document, sort_keys=True, default=str))
    else:
        for line in lines:
            typer.echo(line)


@contextmanager
def _refusals(as_json: bool):
    """A typed client error becomes exit status 1 with its code, not a traceback."""
    try:
        yield
    except CgstoreError as err:
        document = {"error": {"type": type(err).__name__, "code": getattr(err, "code", None), "message": str(err)}}
        if as_json:
            typer.echo(json.dumps(document, sort_keys=True))
        else:
            typer.echo(f"error: {error_label(err)}: {err}", err=True)
        raise typer.Exit(1) from None


def error_label(err: CgstoreError) -> str:
    """The protocol code when the store answered one (``KEY_CONFLICT``), else the error's kind (``unavailable``)."""
    code = getattr(err, "code", None)
    return code or re.sub(r"(?<!^)(?=[A-Z])", "_", type(err).__name__).lower()


@contextmanager
def _progress(as_json: bool, description: str, total: int | None):
    """A rich progress bar on a terminal; a no-op callback otherwise."""
    if as_json or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def _result_document(result: Loaded | Eager) -> dict[str, Any]:
    if isinstance(result, Eager):
        return {"key": result.key, "status": "eager", "reason": result.reason}
    return {
        "key": result.key,
        "status": "loaded",
        "repo": result.repo,
        "artifact": str(result.artifact_path),
        "components": {n: str(p) for n, p in result.component_paths.items()},
        "lane": result.lane,
        "lane_reason": result.lane_reason,
    }


@app.command()
def resolve(family: str, keys: list[str], as_json: JsonFlag = False) -> None:
    """Ask the store which keys it holds (one call)."""
    with _refusals(as_json), _client() as client:
        answers = client.resolve(family, keys)
    _emit(as_json, answers, [f"{a['key']} {a['status']} {a.get('repo', '')}".rstrip() for a in answers])


@app.command()
def fetch(
    repo: str,
    digest: str,
    size: Annotated[int | None, typer.Option(help="Expected size in bytes.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Download one blob into the cache, verified; print its path."""
    with _refusals(as_json), _client() as client, _progress(as_json, digest[:19], size) as progress:
        path = client.fetch_blob(repo, digest, size, progress=progress)
    _emit(as_json, {"digest": digest, "path": str(path)}, [str(path)])


@app.command()
def load(
    family: str,
    keys: list[str],
    mandatory: Annotated[list[str] | None, typer.Option(help="A key that must be served compiled.")] = None,
    device_total_bytes: Annotated[int | None, typer.Option(help="This card's total memory, for the lane.")] = None,
    root_only: Annotated[bool, typer.Option(help="Serve only records whose receipt proves them root's.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Boot: resolve the keys and download every hit, verified."""
    wants = [Want(key, mandatory=key in (mandatory or []), root_only=root_only) for key in keys]
    with _refusals(as_json), _client() as client:
        results = client.load(family, wants, device_total_bytes=device_total_bytes)
    documents = [_result_document(r) for r in results]
    _emit(as_json, documents, [f"{d['key']} {d['status']} {d.get('reason') or d.get('artifact')}" for d in documents])


@app.command()
def publish(
    repo: str,
    archive: Path,
    family: Annotated[str, typer.Option(help="Model family.")],
    envelope: Annotated[str, typer.Option(help='Envelope as JSON, e.g. \'{"shapes": [[512, 512]], "text_len": 0}\'.')],
    sm: Annotated[
        str | None, typer.Option(help="The sm the archive was compiled for; default: the archive's own.")
    ] = None,
    toolchain: Annotated[str | None, typer.Option(help="Toolchain as JSON; default: this environment's.")] = None,
    lane: Annotated[str | None, typer.Option(help="Kernel lane.")] = None,
    component: Annotated[list[str] | None, typer.Option(help="name=path of a component (repeatable).")] = None,
    release: Annotated[str | None, typer.Option(help="A release label discover can narrow to.")] = None,
    code: Annotated[str | None, typer.Option(help="The model source's code fingerprint (cf1:…).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Publish a minted archive (and its components) under its derived key."""
    with _refusals(as_json), _client() as client:
        components = dict(item.split("=", 1) for item in component) if component else None
        published = client.publish(
            repo,
            archive,
            family=family,
            envelope=_json_option("envelope", envelope),
            toolchain=_toolchain(toolchain),
            sm=sm or _archive_sm(archive),
            lane=lane,
            components=components,
            release=release,
            code=code,
        )
    _emit(as_json, {"key": published.key, "status": published.status}, [f"{published.key} {published.status}"])


def _json_option(name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise typer.BadParameter(f"--{name} is not JSON: {err}") from None


def _toolchain(text: str | None) -> Any:
    """``--toolchain`` as given, else this environment's (the one ``client.boot`` declares by default)."""
    if text is not None:
        return _json_option("toolchain", text)
    from cgstore_client.environment import environment_toolchain

    return environment_toolchain()


def _archive_sm(archive: Path) -> str:
    from cgstore_client.archive import inspect as read_archive

    return read_archive(archive).sm


@app.command()
def discover(
    family: str,
    envelope: Annotated[str, typer.Option(help="Envelope as JSON, as published.")],
    sm: Annotated[str | None, typer.Option(help="Default: this machine's (cpu, or cuda:0's).")] = None,
    toolchain: Annotated[str | None, typer.Option(help="Toolchain as JSON; default: this environment's.")] = None,
    release: Annotated[str | None, typer.Option(help="Only records of this release label.")] = None,
    binding_signature: Annotated[str | None, typer.Option(help="Only records binding these tensors (bs1:…).")] = None,
    code: Annotated[str | None, typer.Option(help="Only records minted from this code (cf1:…).")] = None,
    explain: Annotated[
        bool, typer.Option(help="On a miss, say why: the family's records, the nearest's axes.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Find the live records of a declaration (what ``client.boot`` asks), best first. Exit 1 on a miss."""
    from cgstore_client.worker import discovery

    with _refusals(as_json), _client() as client:
        request = discovery.discover_request(
            family,
            envelope=_json_option("envelope", envelope),
            sm=sm or _environment_sm(),
            toolchain=_toolchain(toolchain),
            release=release,
            binding_signature=binding_signature,
            code=code,
            explain=explain,
        )
        found = discovery.discover_answer(client, request)
    answer = found.answer
    lines = [f"{c.key} {c.repo} {c.release or '-'} {c.binding_signature or '-'}" for c in answer.candidates]
    if not answer.candidates:
        lines = [f"miss: {answer.miss.detail}" if answer.miss else "miss: no candidate for this declaration"]
    if found.from_cache:
        lines.append(f"(from the local cache: {found.from_cache})")
    _emit(as_json, {**answer.model_dump(mode="json"), "from_cache": found.from_cache}, lines)
    if not answer.candidates:
        raise typer.Exit(1)


def _environment_sm() -> str:
    from cgstore_client.environment import environment_sm

    return environment_sm()


@app.command("inspect")
def inspect_archive(
    archive: Path,
    envelope: Annotated[
        str | None, typer.Option(help="Envelope as JSON: derive the key it would publish under.")
    ] = None,
    toolchain: Annotated[
        str | None, typer.Option(help="Toolchain as JSON (with --envelope); default: this environment's.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Read an archive as the store will (statically): key, sm, input contract, binding table."""
    from cgstore_client.archive import inspect as read_archive
    from cgstore_client.binding import signature_from_table
    from cgstore_client.keys import Envelope, Toolchain, ck1

    with _refusals(as_json):
        report = read_archive(archive)
        key = None
        if envelope is not None:
            chain = _toolchain(toolchain)
            chain = chain if isinstance(chain, Toolchain) else Toolchain(chain)
            key = ck1(report.graph_digest, Envelope.from_dict(_json_option("envelope", envelope)), report.sm, chain)
    signature = signature_from_table(report.binding_table, report.metadata.ties)
    document = {
        "key": key,
        "kind": report.kind,
        "sm": report.sm,
        "graph_digest": report.graph_digest,
        "binding_signature": signature,
        "input_contract": report.input_contract,
        "binding_table": report.binding_table,
    }
    _emit(as_json, document, _inspect_lines(document))


def _inspect_lines(document: dict[str, Any]) -> list[str]:
    contract = document["input_contract"]
    lines = [
        f"key        {document['key'] or '- (give --envelope to derive it)'}",
        f"kind       {document['kind']}",
        f"sm         {document['sm']}",
        f"graph      {document['graph_digest']}",
        f"binding    {document['binding_signature']}",
        "inputs",
    ]
    lines += [
        f"  {spec['name']}  {spec.get('dtype')}  {spec.get('shape')}  {spec.get('path', '')}"
        for spec in contract.get("inputs") or []
    ]
    lines += [
        f"  {name} in [{bounds.get('min')}, {bounds.get('max')}]"
        for name, bounds in (contract.get("dims") or {}).items()
    ]
    lines.append("binding table (fqn, dtype, shape, kind)")
    lines += [
        f"  {row['fqn']}  {row.get('dtype')}  {row.get('shape')}  {row.get('kind')}"
        for row in document["binding_table"]
    ]
    return lines


@app.command()
def preflight(
    repo: str,
    min_ttl_s: Annotated[int, typer.Option(help="Seconds the token must stay valid.")] = 300,
    as_json: JsonFlag = False,
) -> None:
    """Check this token could publish to the repo now (and for min-ttl-s)."""
    with _refusals(as_json), _client() as client:
        client.preflight(repo, min_ttl_s)
    _emit(as_json, {"repo": repo, "ok": True}, [f"{repo}: publish allowed"])


@app.command()
def verify(as_json: JsonFlag = False) -> None:
    """Re-hash every cached blob; remove the ones that no longer match (exit 1 if any)."""
    client = _client()
    good, bad = [], []
    for digest, _path in list(client.cache.blobs()):
        (good if client.cache.rehash(digest) else bad).append(digest)
    _emit(
        as_json,
        {"verified": good, "removed": bad},
        [f"{len(good)} blobs verified, {len(bad)} removed", *(f"removed {d}" for d in bad)],
    )
    if bad:
        raise typer.Exit(1)


@cache_app.command("ls")
def cache_ls(as_json: JsonFlag = False) -> None:
    """List cached blobs: digest, size, last use."""
    client = _client()
    rows = [{"digest": d, "size": p.stat().st_size, "last_used": p.stat().st_atime} for d, p in client.cache.blobs()]
    _emit(
        as_json,
        rows,
        [
            f"{r['digest']} {r['size']:>14} {time.strftime('%Y-%m-%d %H:%M', time.localtime(r['last_used']))}"
            for r in rows
        ],
    )


def _duration_s(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if not text or text[-1] not in units or not text[:-1].isdigit():
        raise typer.BadParameter("a duration like 30m, 12h or 7d")
    return int(text[:-1]) * units[text[-1]]


@cache_app.command("prune")
def cache_prune(
    older_than: Annotated[str, typer.Option(help="Remove blobs not used for this long (30m, 12h, 7d).")] = "7d",
    as_json: JsonFlag = False,
) -> None:
    """Remove blobs not used for a while (and the records that point at them)."""
    client = _client()
    removed = client.cache.prune(time.time() - _duration_s(older_than))
    _emit(as_json, {"removed": removed}, [f"removed {d}" for d in removed] or ["nothing to prune"])
