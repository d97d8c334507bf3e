"""Access decisions: who may read, write, manage, claim and attenuate what. Values, not effects.

Every function here is pure: it takes verified ``Claims`` and the facts a
service looked up (is the principal a registered platform principal? who holds
the owner?) and answers a ``Decision``. Services ask, then ``enforce()``; the
rules live only here. Where a query must narrow to what may be read before
reading (resolve, discover), the narrowing is built here too, as a statement
the service runs (``search_candidates``), never written in the service. The rules:

Reading
  - ``root/*`` is readable by every valid token.
  - Elsewhere a ``read`` grant matching owner and repo (``write`` implies ``read``).
  - A refused read is answered as a miss identical to an absent thing
    (the caller raises ``hidden_miss``), never as 403.

Private tenant caches (a repo with visibility ``principal``)
  - On top of the read rule, each principal reads only what that principal
    put there: the records it published (``publisher``) and the blobs it
    uploaded or mounted there (``repo_blob_holders``). Everyone else with a read
    grant gets, in resolve, record reads, listings and blob HEAD/GET, exactly
    the miss an absent key or digest gets (status, body, headers). No grant
    lifts this, ``admin`` included: a tenant's cache is that tenant's.
  - Writing is the write rule; but a blob counts as present in the repo, for
    ``blobs:missing`` and for the blobs a publish names, only when the caller
    holds it. A second tenant with the same bytes uploads them (they are hashed,
    never trusted) and holds its own link; knowing a digest grants nothing.
  - ``owner`` repos: a read grant reads everything in the repo.

Writing (blob uploads, mounts, publishes; the preflight asks the same question)
  - A ``write`` grant matching owner and repo, else 403 ``DENIED``.
  - Owner authority: a tenant writes only under owners it holds (claimed with
    ``POST /v1/owners``) or that a grant names literally. A wildcard owner
    pattern (``*/*``, ``acme-*/x``) reaches only the caller's own owners.
  - The root gate, for the reserved owners (``root``, ``admin``, ``platform``,
    ``system``, ``api``): three locks, all required, checked independently —
    (a) a grant naming the owner literally (``*`` never matches a reserved
    owner), (b) the token carries ``plt``, (c) the principal is registered as
    a platform principal (looked up live). Any lock open: 403 ``ROOT_RESERVED``
    with the open locks listed.
  - Preflight: the write decision, plus the token must stay valid for at least
    ``min_ttl_s`` (else 403 ``DENIED``): a mint child learns it would fail
    before it spends minutes compiling.

Claiming a mint (``POST /v1/repos/{o}/{r}/compiled-graphs:claim``, its heartbeat and release)
  - Exactly the publish gates: the write rule above (root: the three locks,
    403 ``ROOT_RESERVED``; elsewhere 403 ``DENIED``), with the preflight's
    token lifetime, here the claim's TTL (a token that lapses before its first
    claim would lapse cannot hold one). A claim is a promise to publish there:
    a caller that could not publish must not make the fleet wait for it.
  - Beating or releasing a claim: only the principal holding it. Anyone
    else's beat or release is answered as for an unknown claim (404
    ``NAME_UNKNOWN``), audited as the denial it is.
  - In a private cache, claims follow record visibility: each principal's
    claims are its own (another's neither shows nor blocks).
  - Clearing a ``failing`` declaration: a store admin (the console, ``cgstore claims clear`` on the host).

Managing a repo (``PUT /v1/repos/{o}/{r}`` creates it or changes its visibility)
  - Reserved owners: the root gate. Elsewhere an ``admin`` grant matching the
    repo, or the holder of the owner with a ``write`` grant matching the repo.
  - Changing an existing repo's visibility needs, on top, owner-level rights:
    holding the owner (``owners.service.held_by``), or a platform token (``plt``)
    of a registered platform principal. A repo-scoped ``admin`` grant alone
    creates a repo with any visibility but never flips one: ``principal`` to
    ``owner`` would show every tenant's records to every reader, the reverse
    would hide the owner's repo from its own readers. Else 403 ``DENIED``.

Yanking a record (``POST .../compiled-graphs/{key}:yank``)
  - An ``admin`` grant over ``*/*``; under a reserved owner also the root gate,
    exactly as for publishing there (any admin write under a reserved owner
    needs the platform): a non-platform store admin gets 403 ``ROOT_RESERVED``
    naming the open locks, and the record stays live.
  - The yank addresses one record, named by key and publisher: in a private
    cache a key has a live record per publisher, so the body's ``publisher``
    (default: the caller) names whose; elsewhere the key's one live record
    (``publisher``, if given, must be its publisher). The answer is the yanked
    ``Record`` (repo, key, publisher). Only a visibility change can leave one
    key several live records to choose from there: several publishers' is 409
    ``CONFLICT`` listing them (name one); one publisher's, the oldest goes first.
    Naming another tenant's record is a store admin's write (the admin token
    is the whole store), not a read: no read grant reaches a private record.

Resolving (``POST /v1/compiled-graphs:resolve``, and discover): which readable repos are searched, in what order
  - ``root`` first; then repos under owners the caller holds; then repos under
    owners a grant names literally (an admin's explicit delegation). Within each
    group by owner, repo name, then record id: a deterministic answer.
  - A repo readable only through a wildcard owner (``*/*:read``, ``acme-*/x``)
    under an owner the caller does not hold is not searched at all. Resolve
    hands back code the worker loads and runs, and any tenant may publish any
    key under its own owner: searching it would let one tenant plant the
    artifact another tenant's worker runs. As for writes, a wildcard owner
    means the caller's own owners. ``GET`` and the listing still read there.
  - In a searched private cache only the caller's own records count (Reading).
  - The search is planned before any record is read (``searched_repos``): the
    repos, their order and whose records each shows. The record query then
    touches only rows the caller may read, so neither its answer nor its
    duration depends on what the caller cannot see.

Claiming an owner (``POST /v1/owners``)
  - The slug must be a valid owner name, strict ASCII, never normalized
    (``Root``, Cyrillic ``rооt``, full-width ``ｒｏｏｔ``, ``root-``: 400 ``NAME_INVALID``).
  - A reserved slug: 403 ``ROOT_RESERVED``, whoever asks.
  - An ``owner:create`` grant over the whole owner (``<pattern>/*``), else 403 ``DENIED``.

Administering the store (mint, list, revoke tokens; the audit)
  - An ``admin`` grant over ``*/*``.

Attenuating (``POST /v1/tokens/attenuate``)
  - Every requested grant and action covered by one parent grant; ``exp`` no
    later than the parent's; ``plt`` only if the parent has it. Anything wider:
    403 ``DENIED`` naming every part that was wider. ``admin`` is an action like
    any other: a child holds it only where the parent did.
  - A wildcard owner stays "the holder's own owners" through any attenuation:
    a child grant naming an owner literally with ``write`` or ``admin`` is
    covered by a parent's wildcard owner only when the principal holds that
    owner (the parent could write there itself). Otherwise the literal name
    would be authority (see Writing) that no ancestor had.
  - The chain stays within ``MAX_CHAIN_DEPTH`` tokens: a deeper child would
    never verify, so it is refused (400) rather than minted (checked by the
    tokens service, which walks the stored chain).

Scraping metrics (``GET /metrics``)
  - Only with ``Authorization: Bearer <CGSTORE_METRICS_TOKEN>``, compared in
    constant time. Unset, nobody may. A refused scrape is answered exactly as
    an unknown path: the endpoint's existence is not advertised.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import ColumnElement, Select, and_, false, or_, select, union

from cgstore.core.errors import Denied, RootReserved, StoreError
from cgstore.core.names import ROOT_OWNER, is_reserved_owner, validate_owner, validate_repo
from cgstore.owners.models import Owner
from cgstore.repos.models import PRIVATE, Repo
from cgstore.tokens.claims import Claims
from cgstore.tokens.grants import ADMIN, OWNER_CREATE, READ, WILDCARD, WRITE, Grant, is_glob, is_subset

LOCK_GRANT = "a grant naming the owner literally"
LOCK_PLT = "a platform token (plt)"
LOCK_PLATFORM = "a registered platform principal"


@dataclass(frozen=True)
class Decision:
    """An answer: allowed, or the refusal to raise."""

    allowed: bool
    refusal: StoreError | None = None

    def enforce(self) -> None:
        if self.refusal is not None:
            raise self.refusal


ALLOWED = Decision(True)


def _refuse(error: StoreError) -> Decision:
    return Decision(False, error)


# -- reading ----------------------------------------------------------------------------


def can_read(claims: Claims, owner: str, repo: str) -> Decision:
    if owner == ROOT_OWNER or claims.allows(owner, repo, READ):
        return ALLOWED
    return _refuse(Denied(f"token grants no read on {owner}/{repo}", repo=f"{owner}/{repo}"))


def private_reader(claims: Claims, visibility: str) -> str | None:
    """Whose records and blobs alone ``claims`` may see in a repo of ``visibility``; None: everyone's.

    Services filter their queries by it (publisher, blob holder) so that the
    rows of other principals are never even loaded.
    """
    return claims.sub if visibility == PRIVATE else None


def can_read_item(claims: Claims, visibility: str, put_there_by: str) -> bool:
    """Whether a record (its publisher) or a blob link (its holder) in a readable repo is visible to ``claims``."""
    reader = private_reader(claims, visibility)
    return reader is None or reader == put_there_by


# -- writing ------------------------------------------------------------------------------


def root_gate(claims: Claims, owner: str, repo: str, *, platform_principal: bool) -> Decision:
    """The three locks of a reserved owner, each checked on its own."""
    missing = []
    if not _named_literally(claims, owner, repo, WRITE):
        missing.append(LOCK_GRANT)
    if not claims.plt:
        missing.append(LOCK_PLT)
    if not platform_principal:
        missing.append(LOCK_PLATFORM)
    if not missing:
        return ALLOWED
    return _refuse(
        RootReserved(
            f"'{owner}' is a reserved namespace: writing there needs {LOCK_GRANT}, {LOCK_PLT} "
            f"and {LOCK_PLATFORM}; missing: {', '.join(missing)}",
            owner=owner,
            missing=missing,
        )
    )


def can_write(claims: Claims, owner: str, repo: str, *, platform_principal: bool, holder: str | None) -> Decision:
    """Whether ``claims`` may write ``owner/repo``. Invalid names raise ``NameInvalid`` first."""
    validate_owner(owner)
    validate_repo(repo)
    if is_reserved_owner(owner):
        return root_gate(claims, owner, repo, platform_principal=platform_principal)
    if not claims.allows(owner, repo, WRITE):
        return _refuse(Denied(f"token grants no write on {owner}/{repo}", repo=f"{owner}/{repo}"))
    if holder != claims.sub and not _named_literally(claims, owner, repo, WRITE):
        return _refuse(
            Denied(
                f"owner '{owner}' is not held by {claims.sub!r} and no grant names it: "
                "a wildcard grant writes only under the caller's own owners",
                repo=f"{owner}/{repo}",
            )
        )
    return ALLOWED


def preflight(claims: Claims, write: Decision, *, now: int, min_ttl_s: int) -> Decision:
    """The write decision, and the token still valid ``min_ttl_s`` from now."""
    if not write.allowed:
        return write
    remaining = claims.exp - now
    if remaining < min_ttl_s:
        return _refuse(
            Denied(
                f"token expires in {max(remaining, 0)} s, before the {min_ttl_s} s the caller needs",
                expires_in_s=max(remaining, 0),
                min_ttl_s=min_ttl_s,
            )
        )
    return ALLOWED


def can_claim(claims: Claims, write: Decision, *, now: int, ttl_s: float) -> Decision:
    """A mint claim: the publish gates (``write``, from ``can_write``) and the token valid for the claim's TTL."""
    return preflight(claims, write, now=now, min_ttl_s=math.ceil(ttl_s))


def holds_claim(claims: Claims, holder: str | None) -> bool:
    """Whether ``claims`` may beat or release a claim held by ``holder`` (its principal only)."""
    return holder is not None and hmac.compare_digest(holder.encode(), claims.sub.encode())


def _named_literally(claims: Claims, owner: str, repo: str, action: str) -> bool:
    return any(g.owner_pattern == owner and g.allows(owner, repo, action) for g in claims.grants)


# -- managing -----------------------------------------------------------------------------


def can_manage_repo(claims: Claims, owner: str, repo: str, *, platform_principal: bool, holder: str | None) -> Decision:
    validate_owner(owner)
    validate_repo(repo)
    if is_reserved_owner(owner):
        return root_gate(claims, owner, repo, platform_principal=platform_principal)
    if claims.allows(owner, repo, ADMIN) or (holder == claims.sub and claims.allows(owner, repo, WRITE)):
        return ALLOWED
    return _refuse(
        Denied(
            f"managing {owner}/{repo} needs an admin grant on it, or holding owner '{owner}' with a write grant",
            repo=f"{owner}/{repo}",
        )
    )


def can_change_visibility(
    claims: Claims, owner: str, repo: str, *, platform_principal: bool, holder: str | None
) -> Decision:
    """Managing the repo, and owner-level rights to flip its visibility (held owner, or the platform)."""
    manage = can_manage_repo(claims, owner, repo, platform_principal=platform_principal, holder=holder)
    if not manage.allowed or is_reserved_owner(owner):  # reserved: the root gate already is the platform's
        return manage
    if holder == claims.sub or (claims.plt and platform_principal):
        return ALLOWED
    return _refuse(
        Denied(
            f"changing the visibility of {owner}/{repo} needs holding owner '{owner}' or a platform token",
            repo=f"{owner}/{repo}",
        )
    )


def can_yank(claims: Claims, owner: str, repo: str, *, platform_principal: bool) -> Decision:
    """A store admin; under a reserved owner also the root gate (an admin write there is the platform's)."""
    validate_owner(owner)
    validate_repo(repo)
    admin = is_admin(claims)
    if not admin.allowed or not is_reserved_owner(owner):
        return admin
    return root_gate(claims, owner, repo, platform_principal=platform_principal)


def can_claim_owner(claims: Claims, slug: object) -> Decision:
    validate_owner(slug)  # strict ASCII: look-alikes are invalid, never normalized
    if is_reserved_owner(slug):
        return _refuse(RootReserved(f"'{slug}' is a reserved owner: it can never be claimed", owner=slug))
    if not claims.allows_owner(slug, OWNER_CREATE):
        return _refuse(Denied(f"token grants no owner:create over '{slug}/*'", owner=slug))
    return ALLOWED


def is_admin(claims: Claims) -> Decision:
    if any(ADMIN in g.actions and g.owner_pattern == g.repo_pattern == WILDCARD for g in claims.grants):
        return ALLOWED
    return _refuse(Denied("this route needs an admin token (a grant '*/*' with the admin action)"))


# -- resolving ---------------------------------------------------------------------------

RANK_ROOT, RANK_HELD, RANK_NAMED = 0, 1, 2


def resolve_rank(claims: Claims, owner: str, repo: str, *, holder: str | None) -> int | None:
    """Where ``owner/repo``'s records stand in a resolve by ``claims`` (lower first); None: not searched."""
    if owner == ROOT_OWNER:
        return RANK_ROOT
    if not claims.allows(owner, repo, READ):
        return None
    if holder == claims.sub:
        return RANK_HELD
    if _named_literally(claims, owner, repo, READ):
        return RANK_NAMED
    return None  # reached through a wildcard owner only: another tenant's


def search_candidates(claims: Claims) -> Select:
    """SQL: the repos ``resolve_rank`` can search for ``claims``, as ``(id, owner, name, visibility, holder)``.

    The repos under the owners ``claims.sub`` holds, ``root``'s, those under an
    owner a read grant names literally with a glob for the repo, and those a
    read grant names outright. Each branch is a lookup by the owners' index or
    the repos' ``(owner, name)``, with literal values the planner can judge: no
    other tenant's repo is read, however many there are. A narrowing, never
    the decision: ``searched_repos`` still ranks each repo found.
    """
    columns = (Repo.id, Repo.owner, Repo.name, Repo.visibility, Owner.principal.label("holder"))
    held = select(*columns).join(Owner, Owner.slug == Repo.owner).where(Owner.principal == claims.sub)
    owners, repos = {ROOT_OWNER}, set()
    for grant in claims.grants:
        if READ in grant.effective_actions and not is_glob(grant.owner_pattern):
            if is_glob(grant.repo_pattern):
                owners.add(grant.owner_pattern)
            else:
                repos.add((grant.owner_pattern, grant.repo_pattern))
    by_name = select(*columns).outerjoin(Owner, Owner.slug == Repo.owner)
    branches = [held, by_name.where(Repo.owner.in_(sorted(owners)))]
    if repos:
        branches.append(
            by_name.where(or_(*(and_(Repo.owner == owner, Repo.name == name) for owner, name in sorted(repos))))
        )
    return union(*branches)


@dataclass(frozen=True)
class SearchedRepo:
    """A repo resolve and discover search: its ``resolve_rank``, its place in the search, whose records it shows.

    ``position`` orders the searched repos by rank, owner and name (a record's
    place is its repo's, then its id); ``reader`` is ``private_reader``: the
    one publisher whose records the caller sees there, or None for everyone's.
    """

    id: int
    owner: str
    name: str
    rank: int
    position: int
    reader: str | None


def searched_repos(claims: Claims, repos: Iterable[tuple[int, str, str, str, str | None]]) -> list[SearchedRepo]:
    """The search plan over candidate repos ``(id, owner, name, visibility, holder)``, best first.

    The candidates are those ``search_candidates`` found; the ones ``resolve_rank``
    does not search are dropped.
    """
    ranked = []
    for repo_id, owner, name, visibility, holder in repos:
        rank = resolve_rank(claims, owner, name, holder=holder)
        if rank is not None:
            ranked.append((rank, owner, name, repo_id, private_reader(claims, visibility)))
    return [
        SearchedRepo(repo_id, owner, name, rank, position, reader)
        for position, (rank, owner, name, repo_id, reader) in enumerate(sorted(ranked))
    ]


def readable_in(
    searched: Iterable[SearchedRepo], repo_id: ColumnElement[int], publisher: ColumnElement[str]
) -> ColumnElement[bool]:
    """SQL: the records of the ``searched`` repos the caller may read, by their ``repo_id`` and ``publisher``.

    Every record of a repo whose ``reader`` is None; only the reader's own in a
    private cache (Reading). False when nothing is searched.
    """
    by_reader: dict[str | None, list[int]] = {}
    for repo in searched:
        by_reader.setdefault(repo.reader, []).append(repo.id)
    terms = [
        repo_id.in_(ids) if reader is None else and_(repo_id.in_(ids), publisher == reader)
        for reader, ids in sorted(by_reader.items(), key=lambda item: item[0] or "")
    ]
    return or_(*terms) if terms else false()


# -- attenuating ----------------------------------------------------------------------------


def can_attenuate(
    parent: Claims, grants: tuple[Grant, ...], *, exp: int, plt: bool, held_owners: frozenset[str]
) -> Decision:
    """A child with ``grants``, ``exp`` and ``plt`` must be no wider than ``parent`` in any part.

    ``held_owners``: the owners ``parent.sub`` holds among those the child names literally.
    """
    wider = [f"grant {g.to_cli()}" for g in grants if not is_subset((g,), parent.grants, held_owners=held_owners)]
    if exp > parent.exp:
        wider.append(f"exp {exp} is later than the parent's {parent.exp}")
    if plt and not parent.plt:
        wider.append("plt (the parent is not a platform token)")
    if not wider:
        return ALLOWED
    return _refuse(Denied(f"the requested token is wider than its parent: {'; '.join(wider)}", wider=wider))


# -- metrics ----------------------------------------------------------------------------


def can_scrape_metrics(authorization: str | None, metrics_token: str | None) -> bool:
    """Whether an ``Authorization`` header carries the configured metrics token (never when unset)."""
    if not metrics_token or not authorization:
        return False
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # compare_digest: the time taken says nothing about how much of a guess was right.
    return hmac.compare_digest(presented.strip().encode(), metrics_token.encode())
