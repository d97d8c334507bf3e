"""Search: batch resolve by ck1 key and discover by declaration, over only the rows the caller may read.

Both first plan the repos the caller searches (``access.searched_repos``), then
one statement over those repos' live rows picks the best record per key (root,
held owners, named owners; newest first), discover's order and limit included;
then the chosen records' components. A miss is identical for an absent,
yanked, unhealthy or unreadable key, and the work done does not depend on what
the caller cannot see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic_core import to_json
from sqlalchemy import Integer, case, func, literal_column, or_, select, true, union_all
from sqlalchemy.orm import Session

from cgstore import access
from cgstore.blobs.models import Blob
from cgstore.compiled_graphs import admission, explain
from cgstore.compiled_graphs.models import HEALTH_OK, CompiledGraph, CompiledGraphComponent
from cgstore.context import StoreContext
from cgstore.core.db import in_values, pg_array, plan_without_values
from cgstore.core.errors import (
    KeyInvalid,
    MetadataInvalid,
)
from cgstore.core.urls import public_location
from cgstore.tokens.claims import Claims
from cgstore_client.binding import is_binding_signature
from cgstore_client.keys import is_key
from cgstore_client.wire.discovery import DEFAULT_DISCOVER_LIMIT, Declaration, DiscoverRequest, MissExplanation
from cgstore_client.wire.records import (
    ResolveRequest,
)

#: A blob of a repo: ``(owner, repo, digest)``.
BlobRef = tuple[str, str, str]


#: Download URLs for many blobs at once (presigning is batched): ``[ref, ...] -> {ref: url}``.
UrlsFor = Callable[[list[BlobRef]], dict[BlobRef, str]]


def download_urls(ctx: StoreContext) -> UrlsFor:
    """Presigned storage URLs when the backend redirects downloads, else the store's own blob URL (under
    ``CGSTORE_PUBLIC_URL``, or a path relative to the store: never built from the request's ``Host``)."""
    if ctx.settings.redirect_downloads and ctx.storage.supports_presign:
        ttl = ctx.settings.presign_ttl_s

        def presigned(refs: list[BlobRef]) -> dict[BlobRef, str]:
            by_digest = ctx.storage.presigned_urls([digest for _, _, digest in refs], ttl)
            return {ref: by_digest[ref[2]] for ref in refs}

        return presigned
    public_url = ctx.settings.public_url
    return lambda refs: {
        ref: public_location(public_url, f"/v1/repos/{ref[0]}/{ref[1]}/blobs/{ref[2]}") for ref in refs
    }


_RESOLVE_COLUMNS = (
    CompiledGraph.id,
    CompiledGraph.key,
    CompiledGraph.kind,
    CompiledGraph.format,
    CompiledGraph.family,
    CompiledGraph.lane,
    CompiledGraph.sm,
    CompiledGraph.graph_digest,
    CompiledGraph.envelope_digest,
    CompiledGraph.toolchain_digest,
    CompiledGraph.layout_display,
    CompiledGraph.layout_topology,
    CompiledGraph.layout_quant,
    CompiledGraph.created_at,
    CompiledGraph.artifact_digest,
    CompiledGraph.artifact_size,
    CompiledGraph.receipt,
    CompiledGraph.repo_id,
)


def resolve(
    ctx: StoreContext, claims: Claims, request: ResolveRequest, urls_for: UrlsFor, *, count: bool = True
) -> bytes:
    """One answer per requested key, in order: the best readable live record, or a miss.

    Returns the ``ResolveAnswer`` JSON itself (see ``_answer``). ``count=False``: not
    counted in the metrics (a mirror counts its answer once, after pulling its misses).
    """
    for key in request.keys:
        if not is_key(key):
            raise KeyInvalid("not a valid key", key=key[:120])
    with ctx.db.session() as session:
        searched = _search_plan(session, claims)
        best: dict[str, Any] = {}
        if searched:
            # Column rows through Core (the session's connection): the ORM's result
            # machinery has nothing to add to plain columns and cost a tenth of a resolve.
            best = {
                row.key: row
                for row in session.connection().execute(
                    _best_per_key(
                        session,
                        searched,
                        (
                            in_values(session, CompiledGraph.key, sorted(set(request.keys))),
                            CompiledGraph.family == request.family,
                        ),
                        _RESOLVE_COLUMNS,
                    )
                )
            }
        components = _component_rows(session, [row.id for row in best.values()])
    repos = {repo.id: repo for repo in searched}
    urls = urls_for(_blob_refs(best.values(), repos, components))
    hits = {key: _answer(key, row, repos, components, urls) for key, row in best.items()}
    answers = [hits.get(key) or {"key": key, "status": "miss"} for key in request.keys]
    if count:
        hit_count = sum(1 for key in request.keys if key in hits)
        ctx.metrics.count_resolve(request.family, hit_count, len(answers) - hit_count)
    # Serialized once, in pydantic-core, from plain data built in the wire types'
    # field order: validating 128 hits into models only to dump them again was a
    # fifth of a resolve's CPU. tests/compiled_graphs/test_resolve_api.py checks
    # the bytes are exactly what ``ResolveAnswer`` itself serializes.
    return to_json({"answers": answers})


def _search_plan(session: Session, claims: Claims) -> list[access.SearchedRepo]:
    """The repos a resolve or discover by ``claims`` searches, best first (``access.searched_repos``).

    Read from the repos the caller can be searching at all
    (``access.search_candidates``), so other tenants' repos, however many, are never read; and
    every statement of the search planned without its values (``plan_without_values``).
    """
    plan_without_values(session)
    return access.searched_repos(claims, session.connection().execute(access.search_candidates(claims)))


def _best_per_key(
    session: Session, searched: list[access.SearchedRepo], match: tuple, columns: tuple, *, limit: int | None = None
):
    """The statement of ``columns`` of the best live, healthy record per key among ``match``es in ``searched``.

    Only rows the caller may read are ever touched (``_candidates``). The
    best of a key is the record of the first searched repo, then the lowest id
    (``access`` "Resolving"). With ``limit``: the first ``limit`` of them by
    their repo's rank, then newest first (discover's order). The choosing
    reads ids only; the records' columns are read for the chosen ones.
    """
    rows = _candidates(session, searched, match).subquery("candidates")
    nth = func.row_number().over(partition_by=rows.c.key, order_by=(rows.c.search_position, rows.c.id))
    ranked = select(rows.c.id, rows.c.search_rank, nth.label("nth")).subquery("ranked")
    chosen = (
        select(*columns, ranked.c.search_rank).join(ranked, ranked.c.id == CompiledGraph.id).where(ranked.c.nth == 1)
    )
    if limit is None:
        return chosen
    return chosen.order_by(ranked.c.search_rank, CompiledGraph.id.desc()).limit(limit)


def _candidates(session: Session, searched: list[access.SearchedRepo], match: tuple):
    """``(id, key, search_rank, search_position)`` of the live, healthy ``match``es the caller may read.

    One branch per reader (shared repos; private caches), each found through
    the index led by ``match``'s columns then ``(repo_id, publisher)``
    (``models.py``), in a private cache only the reader's own. The artifact's
    blob row must exist: a record never resolves to bytes the database lacks.
    """
    postgresql = session.get_bind().dialect.name == "postgresql"
    branches = []
    for reader in sorted({repo.reader for repo in searched}, key=lambda reader: reader or ""):
        repos = [repo for repo in searched if repo.reader == reader]
        branches.append(_per_repo_lookups(repos, reader, match) if postgresql else _one_lookup(repos, reader, match))
    return branches[0] if len(branches) == 1 else union_all(*branches)


def _live(*conditions) -> tuple:
    return (*conditions, CompiledGraph.yanked_at.is_(None), CompiledGraph.health == HEALTH_OK)


def _per_repo_lookups(repos: list[access.SearchedRepo], reader: str | None, match: tuple):
    """PostgreSQL: one index lookup per searched repo, the repo's id an equality of the lookup.

    Written as a lateral subquery over the plan's arrays (the ``OFFSET 0``
    keeps it one: a flattened join could scan ``match`` alone). Given
    ``repo_id IN (…)`` instead, a generic plan filtered the ids after reading
    every row of the digest, other tenants' included: with 400 hidden records
    a discover was slower than a miss in 68 % of pairs (issue 30 §2).
    """
    plan = (
        func.unnest(*(pg_array([getattr(repo, field) for repo in repos], Integer) for field in _PLAN_FIELDS))
        .table_valued(*_PLAN_COLUMNS)
        .render_derived(name="plan")
    )
    found = (
        select(CompiledGraph.id, CompiledGraph.key)
        .join(Blob, Blob.digest == CompiledGraph.artifact_digest)
        .where(*_live(*match, CompiledGraph.repo_id == plan.c.repo_id, access.read_by(reader, CompiledGraph.publisher)))
        .offset(0)
        .lateral("found")
    )
    return select(found.c.id, found.c.key, plan.c.search_rank, plan.c.search_position).join_from(plan, found, true())


#: The searched repos' fields ``_per_repo_lookups`` passes, and their columns there.
_PLAN_FIELDS = ("id", "rank", "position")
_PLAN_COLUMNS = ("repo_id", "search_rank", "search_position")


def _one_lookup(repos: list[access.SearchedRepo], reader: str | None, match: tuple):
    """SQLite: one statement over the repos' ids (its planner seeks each value of an ``IN`` in the index)."""
    readable = access.readable_in(repos, CompiledGraph.repo_id, CompiledGraph.publisher)
    return (
        select(CompiledGraph.id, CompiledGraph.key, _per_repo(repos, "rank"), _per_repo(repos, "position"))
        # (No join to repos: the plan knows each searched repo's owner and name.)
        .join(Blob, Blob.digest == CompiledGraph.artifact_digest)
        .where(*_live(*match, readable))
    )


def _per_repo(searched: list[access.SearchedRepo], field: str):
    """SQL: a searched repo's ``field`` by the record's repo id, labelled ``search_<field>``.

    Integers the plan computed, rendered inline: typed as integers, and no
    bound parameters beyond the repo ids' own.
    """
    return case(
        {literal_column(str(int(repo.id))): literal_column(str(int(getattr(repo, field)))) for repo in searched},
        value=CompiledGraph.repo_id,
    ).label(f"search_{field}")


def _component_rows(session: Session, record_ids: list[int]) -> dict[int, list[tuple[str, str, int]]]:
    """``(name, digest, size)`` of the chosen records' components: always one statement."""
    by_record: dict[int, list[tuple[str, str, int]]] = {}
    rows = session.connection().execute(
        select(
            CompiledGraphComponent.record_id,
            CompiledGraphComponent.name,
            CompiledGraphComponent.digest,
            CompiledGraphComponent.size,
        )
        .join(Blob, Blob.digest == CompiledGraphComponent.digest)
        # A bound array on PostgreSQL (constant statement text): an expanding IN of
        # 128 ids was re-rendered and re-split by the driver on every resolve.
        .where(in_values(session, CompiledGraphComponent.record_id, record_ids))
        .order_by(CompiledGraphComponent.record_id, CompiledGraphComponent.name)
    )
    for record_id, name, digest, size in rows:
        by_record.setdefault(record_id, []).append((name, digest, size))
    return by_record


#: The searched repos by id (``_search_plan``): a found row's owner and name, known before any record was read.
SearchedById = dict[int, access.SearchedRepo]


def _blob_refs(rows: Iterable, repos: SearchedById, components: dict[int, list[tuple[str, str, int]]]) -> list[BlobRef]:
    refs = []
    for row in rows:
        owner, name = repos[row.repo_id].owner, repos[row.repo_id].name
        refs.append((owner, name, row.artifact_digest))
        refs += [(owner, name, digest) for _, digest, _ in components.get(row.id, [])]
    return refs


def _answer(
    key: str, row, repos: SearchedById, components: dict[int, list[tuple[str, str, int]]], urls: dict[BlobRef, str]
) -> dict:
    """One hit as plain data, keys in the wire types' field order (``ResolveHit``, ``ComponentDownload``).

    ``row`` starts with ``_RESOLVE_COLUMNS`` (discover's rows carry more after them).
    """
    (
        record_id,
        record_key,
        kind,
        format_,
        family,
        lane,
        sm,
        graph,
        envelope_digest,
        toolchain_digest,
        layout_display,
        layout_topology,
        layout_quant,
        created_at,
        artifact_digest,
        artifact_size,
        receipt,
        repo_id,
    ) = row[: len(_RESOLVE_COLUMNS)]
    owner, name = repos[repo_id].owner, repos[repo_id].name
    layout = None
    if layout_display is not None:
        layout = {"display": layout_display, "topology": layout_topology, "quant": layout_quant}
    return {
        "key": key,
        "status": "hit",
        "repo": f"{owner}/{name}",
        "record": {
            "kind": kind,
            "format": format_,
            "family": family,
            "lane": lane,
            "sm": sm,
            "graph": graph,
            "envelope_digest": envelope_digest,
            "toolchain_digest": toolchain_digest,
            "layout": layout,
            "created_at": created_at,
            "href": f"/v1/repos/{owner}/{name}/compiled-graphs/{record_key}",
        },
        "artifact": {"digest": artifact_digest, "size": artifact_size, "url": urls[(owner, name, artifact_digest)]},
        "components": [
            {"digest": digest, "size": size, "url": urls[(owner, name, digest)], "name": component_name}
            for component_name, digest, size in components.get(record_id, [])
        ],
        "receipt": receipt,
    }


def discover(ctx: StoreContext, claims: Claims, request: DiscoverRequest, urls_for: UrlsFor) -> bytes:
    """The live records matching a declaration, best first, in resolve's hit shape; the answer's JSON.

    Visibility and ranking are resolve's (``_best_per_key``): per key the
    best-ranked readable record, then keys ordered by that rank, newest first,
    at most ``limit``, all decided in SQL over the rows the caller may read.
    Three statements whatever the table holds (the search plan, the records
    through ``ix_compiled_graphs_discover``, the chosen ones' components); an
    answer with nothing readable is the same bytes as one with nothing at all.
    """
    derived, digest = check_declaration(request)
    found, miss = _discover_rows(
        ctx, claims, request, digest, urls_for, request.limit, derived if request.explain else None
    )
    answer: dict[str, Any] = {"candidates": found}  # built in ``DiscoverAnswer``'s field order, as resolve's is
    if miss is not None:
        answer["miss"] = miss.model_dump(mode="json")
    return to_json(answer)


def candidates(
    ctx: StoreContext, claims: Claims, request: Declaration, urls_for: UrlsFor, limit: int = DEFAULT_DISCOVER_LIMIT
) -> list[dict]:
    """What discover would answer ``claims`` for ``request`` (a claim's declaration): its candidates as plain
    data in ``Candidate``'s field order, best first, at most ``limit``; the same search, one implementation."""
    _, digest = check_declaration(request)
    return _discover_rows(ctx, claims, request, digest, urls_for, limit, None)[0]


def _discover_rows(
    ctx: StoreContext,
    claims: Claims,
    request: Declaration,
    digest: str,
    urls_for: UrlsFor,
    limit: int,
    explain_with: admission.Derived | None,
) -> tuple[list[dict], MissExplanation | None]:
    """The matching candidates; on none, with ``explain_with`` (the declaration's derived axes), why."""
    with ctx.db.session() as session:
        searched, chosen = _discovered(session, claims, request, digest, limit)
        components = _component_rows(session, [row.id for row in chosen])
        miss = (
            explain.explain_miss(session, claims, request, explain_with, searched)
            if explain_with is not None and not chosen
            else None
        )
    repos = {repo.id: repo for repo in searched}
    urls = urls_for(_blob_refs(chosen, repos, components))
    found = [
        {
            **_answer(row.key, row, repos, components, urls),
            "binding_signature": row.binding_signature,
            "release": row.release,
        }
        for row in chosen
    ]
    return found, miss


def check_declaration(request: Declaration) -> tuple[admission.Derived, str]:
    """The declaration checked as admission checks a manifest's: its canonical axes and discovery digest.

    Raises what discover answers a bad declaration with (``NAME_INVALID``,
    ``ENVELOPE_INVALID``, ``METADATA_INVALID``); a claim checks its body here too.
    """
    admission.check_family(request.family)
    derived = admission.derive_axes(request.envelope, request.sm, request.toolchain)
    admission.check_release(request.release)
    admission.check_code(request.code)
    if request.binding_signature is not None and not is_binding_signature(request.binding_signature):
        raise MetadataInvalid(
            "binding_signature must be 'bs1:' + 64 lowercase hex (cgstore_client.binding)",
            binding_signature=request.binding_signature,
        )
    return derived, admission.discovery_of(request.family, request.sm, derived)


def _discovered(session: Session, claims: Claims, request: Declaration, digest: str, limit: int) -> tuple[list, list]:
    """The repos this caller searches, and the best readable matching records in them (discover's rows)."""
    searched = _search_plan(session, claims)
    if not searched:
        return searched, []
    columns = (*_RESOLVE_COLUMNS, CompiledGraph.binding_signature, CompiledGraph.release)
    chosen = (
        session.connection()
        .execute(_best_per_key(session, searched, _discover_match(request, digest), columns, limit=limit))
        .all()
    )
    return searched, chosen


@dataclass(frozen=True)
class Explained:
    """What discover answers this caller for a declaration, without blob URLs: the matching records
    (``owner/name``, key), best first, or why there are none (``explain.explain_miss``)."""

    matches: list[tuple[str, str]]
    miss: MissExplanation | None


def explain_declaration(ctx: StoreContext, claims: Claims, request: DiscoverRequest) -> Explained:
    """Discover's answer to ``request`` for ``claims``, explained on a miss (the console's Explain page):
    the same checks, search plan, match and explanation as ``discover``, one implementation."""
    derived, digest = check_declaration(request)
    with ctx.db.session() as session:
        searched, chosen = _discovered(session, claims, request, digest, request.limit)
        miss = None if chosen else explain.explain_miss(session, claims, request, derived, searched)
    repos = {repo.id: repo for repo in searched}
    matches = [(f"{repos[row.repo_id].owner}/{repos[row.repo_id].name}", row.key) for row in chosen]
    return Explained(matches=matches, miss=miss)


def _discover_match(request: Declaration, digest: str) -> tuple:
    """What a record must have to match ``request`` (its discovery ``digest``, then the optional filters)."""
    match = [CompiledGraph.discovery_digest == digest]
    if request.release is not None:
        match.append(CompiledGraph.release == request.release)
    if request.binding_signature is not None:
        match.append(CompiledGraph.binding_signature == request.binding_signature)
    if request.code is not None:  # only records that recorded their code can differ from it
        match.append(or_(CompiledGraph.code_fingerprint.is_(None), CompiledGraph.code_fingerprint == request.code))
    return tuple(match)
