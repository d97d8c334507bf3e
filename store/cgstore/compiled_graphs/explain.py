"""Why a discover found nothing, in the declaration's own terms (issue 25 §2, issue 26 §4).

Five different causes used to give one ``miss``: a family typo, a missing
``batch_sizes``, a release the record lacks, another torch version, another
toolchain spelling. On a miss (when the request asks, ``explain``), the answer
says how many live records the family has in the repos the caller searches,
and for the nearest one which axes differ, with both values::

    3 records of gpt2 in root/family-gpt2; nearest differs in toolchain triton: 3.5.0 here, 3.4.0 recorded

Only records the caller may read count, decided by the same rules as the
search itself: the records are read from the search plan's repos only, in a
private cache only the caller's own (``access.readable_in``; issue 30 §2), so
another principal's private record, or a repo the token does not search, adds
nothing to the count, the nearest or the family suggestions, and cannot crowd
the caller's own out of what is examined: an explanation tells nothing a
listing would not. The records examined are bounded (the newest
``MAX_EXAMINED`` of the family the caller may read; ``at_least`` then says the
count is a floor).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from cgstore import access
from cgstore.compiled_graphs.admission import Derived
from cgstore.compiled_graphs.models import HEALTH_OK, CompiledGraph
from cgstore.owners.models import Owner
from cgstore.repos.models import Repo
from cgstore.tokens.claims import Claims
from cgstore_client.wire.discovery import AxisDifference, DiscoverRequest, MissExplanation, NearestRecord

#: Records of the family looked at for one explanation, newest first.
MAX_EXAMINED = 256
#: Live records looked at to suggest a family when the declared one has none readable.
MAX_FAMILY_ROWS = 2000
#: Repos and differences named in the one-line detail (the structured answer holds them all).
NAMED_REPOS = 3
NAMED_DIFFERENCES = 4
SIMILAR_FAMILIES = 3

_WHERE = (CompiledGraph.yanked_at.is_(None), CompiledGraph.health == HEALTH_OK)
_VISIBILITY_COLUMNS = (Repo.owner, Repo.name, Repo.visibility, Owner.principal.label("holder"), CompiledGraph.publisher)


def explain_miss(
    session: Session,
    claims: Claims,
    request: DiscoverRequest,
    derived: Derived,
    searched: list[access.SearchedRepo],
) -> MissExplanation:
    """The explanation of a discover that matched nothing readable, from the readable records of ``searched``."""
    readable = access.readable_in(searched, CompiledGraph.repo_id, CompiledGraph.publisher)
    rows = session.execute(
        select(
            *_VISIBILITY_COLUMNS,
            CompiledGraph.id,
            CompiledGraph.key,
            CompiledGraph.sm,
            CompiledGraph.envelope,
            CompiledGraph.toolchain,
            CompiledGraph.recorded_versions,
            CompiledGraph.release,
            CompiledGraph.binding_signature,
            CompiledGraph.code_fingerprint,
        )
        .join(Repo, Repo.id == CompiledGraph.repo_id)
        .outerjoin(Owner, Owner.slug == Repo.owner)
        .where(CompiledGraph.family == request.family, readable, *_WHERE)
        .order_by(CompiledGraph.id.desc())
        .limit(MAX_EXAMINED)
    ).all()
    at_least = len(rows) == MAX_EXAMINED
    readable = [(rank, row) for row in rows if (rank := _rank(claims, row)) is not None]  # all of them, checked
    if not readable:
        similar = _similar_families(session, claims, request.family, searched)
        return MissExplanation(detail=_nothing_detail(request.family, similar), records=0, similar_families=similar)
    repos = _repos_by_count(row for _, row in readable)
    scored = [(len(diffs := differences(request, derived, row)), rank, -row.id, row, diffs) for rank, row in readable]
    *_, row, diffs = min(scored, key=lambda item: item[:3])
    nearest = NearestRecord(key=row.key, repo=f"{row.owner}/{row.name}", differences=diffs)
    detail = f"{_count(len(readable), at_least)} of {request.family} in {_named(repos)}; {_nearest_detail(diffs)}"
    return MissExplanation(detail=detail, records=len(readable), at_least=at_least, repos=repos, nearest=nearest)


def _rank(claims: Claims, row) -> int | None:
    """Where the record's repo stands in this caller's search (None: not searched, or not its to read)."""
    rank = access.resolve_rank(claims, row.owner, row.name, holder=row.holder)
    if rank is None or not access.can_read_item(claims, row.visibility, row.publisher):
        return None
    return rank


def differences(request: DiscoverRequest, derived: Derived, row) -> list[AxisDifference]:
    """Every axis on which the record ``row`` differs from the declaration, in the key's order."""
    found: list[AxisDifference] = []
    if row.sm != request.sm:
        found.append(AxisDifference(axis="sm", here=request.sm, recorded=row.sm))
    found += _mapping_differences(
        "envelope", _envelope_fields(derived.envelope.document), _envelope_fields(row.envelope)
    )
    found += _mapping_differences(
        "toolchain", derived.toolchain.components, (row.toolchain or {}).get("components") or {}
    )
    found += _mapping_differences("library", derived.toolchain.recorded, row.recorded_versions or {})
    # Optional filters: only a value the declaration names can differ (absent matches any).
    if request.release is not None and row.release != request.release:
        found.append(AxisDifference(axis="release", here=request.release, recorded=row.release))
    if request.binding_signature is not None and row.binding_signature != request.binding_signature:
        found.append(
            AxisDifference(axis="binding_signature", here=request.binding_signature, recorded=row.binding_signature)
        )
    if request.code is not None and row.code_fingerprint not in (None, request.code):
        found.append(AxisDifference(axis="code", here=request.code, recorded=row.code_fingerprint))
    return found


def _envelope_fields(document: Mapping[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in document.items() if name != "v"}


def _mapping_differences(axis: str, here: Mapping[str, Any], recorded: Mapping[str, Any]) -> list[AxisDifference]:
    return [
        AxisDifference(axis=axis, name=name, here=here.get(name), recorded=recorded.get(name))
        for name in sorted(set(here) | set(recorded))
        if here.get(name) != recorded.get(name)
    ]


def _repos_by_count(rows: Iterable) -> list[str]:
    counts: dict[str, int] = {}
    for row in rows:
        repo = f"{row.owner}/{row.name}"
        counts[repo] = counts.get(repo, 0) + 1
    return sorted(counts, key=lambda repo: (-counts[repo], repo))


def _similar_families(session: Session, claims: Claims, family: str, searched: list[access.SearchedRepo]) -> list[str]:
    """Readable families spelled nearly like ``family`` (a typo), from a bounded look at the readable live records."""
    rows = session.execute(
        select(CompiledGraph.family, *_VISIBILITY_COLUMNS)
        .join(Repo, Repo.id == CompiledGraph.repo_id)
        .outerjoin(Owner, Owner.slug == Repo.owner)
        .where(access.readable_in(searched, CompiledGraph.repo_id, CompiledGraph.publisher), *_WHERE)
        .distinct()
        .limit(MAX_FAMILY_ROWS)
    ).all()
    readable = sorted({row.family for row in rows if _rank(claims, row) is not None})
    return difflib.get_close_matches(family, readable, n=SIMILAR_FAMILIES, cutoff=0.6)


# -- the one-line detail ---------------------------------------------------------------------


def _count(records: int, at_least: bool) -> str:
    return f"{'at least ' if at_least else ''}{records} record{'' if records == 1 else 's'}"


def _named(repos: list[str]) -> str:
    shown = ", ".join(repos[:NAMED_REPOS])
    return shown + (f" (+{len(repos) - NAMED_REPOS} more repos)" if len(repos) > NAMED_REPOS else "")


def _nothing_detail(family: str, similar: list[str]) -> str:
    detail = f"no record of family {family!r} this token may read"
    return detail + (f" (did you mean {', '.join(similar)}?)" if similar else "")


def _nearest_detail(diffs: list[AxisDifference]) -> str:
    if not diffs:  # every axis matches, e.g. a record whose blob row went missing between the two reads
        return "nearest matches every axis named"
    shown = "; ".join(describe(d) for d in diffs[:NAMED_DIFFERENCES])
    more = f" (+{len(diffs) - NAMED_DIFFERENCES} more)" if len(diffs) > NAMED_DIFFERENCES else ""
    return f"nearest differs in {shown}{more}"


def describe(difference: AxisDifference) -> str:
    """``toolchain triton: 3.5.0 here, 3.4.0 recorded``."""
    axis = difference.axis.replace("_", " ") + (f" {difference.name}" if difference.name else "")
    return f"{axis}: {_value(difference.here)} here, {_value(difference.recorded)} recorded"


def _value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return "[" + ", ".join(_value(item) if isinstance(item, list) else str(item) for item in value) + "]"
    return str(value)
