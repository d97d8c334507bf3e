"""A regional mirror's reads: its own rows first; on a miss, ask the upstream once, pull, verify, store, serve.

A store started with ``CGSTORE_UPSTREAM_URL`` answers resolve, discover,
record reads and blob reads from its own database and storage. On a miss (and
only for what the caller could read here: ``access.can_read``, and what the
mirror's filters want: ``wanted``) it asks the upstream once: concurrent misses
of one key, one declaration or one digest share one upstream call
(``flight.SingleFlight``), and an upstream "no" is remembered for
``CGSTORE_MIRROR_NEGATIVE_TTL_S``. A record found there is pulled whole
(``pull_record``): its blobs in parallel ranged parts into storage, each
verified against its digest by the storage writer; the upstream's receipt
verified against the upstream keys the mirror trusts (``trust.py``) and
checked to vouch for this very record (key, repo, artifact, components, graph,
publisher); the key re-derived from the record's axes. Only then is the row
written, in one transaction with its components, blob links, an audit entry
(``mirror.pull``) and the mirror's own feed event, and with the receipt
unchanged and ``origin`` = the upstream's URL: a worker pinning the upstream's
keys (``Client(trusted_jwks=)``) verifies it through the mirror.

Anything that fails a check is refused (``PullRefused``: audited, counted,
answered as a plain miss): a mirror never stores or serves bytes or records
the upstream's keys do not vouch for. An upstream that does not answer within
``CGSTORE_UPSTREAM_TIMEOUT_S`` makes misses answer at once with
``detail.upstream = "unavailable"`` while every held record keeps serving.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import jwt
from filelock import FileLock
from pydantic import ValidationError
from pydantic_core import to_json
from sqlalchemy import select, update

from cgstore import access
from cgstore.audit.service import record as audit
from cgstore.blobs import service as blobs_service
from cgstore.blobs.models import BLOB_OK, Blob, RepoBlob, RepoBlobHolder
from cgstore.compiled_graphs import admission, events, records, search
from cgstore.compiled_graphs.models import HEALTH_OK, CompiledGraph, CompiledGraphComponent
from cgstore.compiled_graphs.publishing import live_query
from cgstore.context import StoreContext
from cgstore.core.db import insert_ignoring_conflicts, utcnow
from cgstore.core.errors import BlobUnknown, NameUnknown, StoreError, Unavailable
from cgstore.core.names import is_valid_owner, is_valid_repo
from cgstore.core.private import private_dir
from cgstore.mirror import trust
from cgstore.mirror.flight import MirrorRuntime
from cgstore.mirror.upstream import UpstreamRefused, UpstreamUnavailable
from cgstore.repos.models import Repo
from cgstore.repos.service import find_repo
from cgstore.tokens.claims import Claims
from cgstore_client.keys import is_key
from cgstore_client.receipts import ReceiptInvalid, ReceiptKeyUnknown
from cgstore_client.wire.discovery import DiscoverRequest
from cgstore_client.wire.records import Record, ResolveRequest

log = logging.getLogger(__name__)

#: What a miss answers while the upstream cannot be asked.
UNAVAILABLE = {"upstream": "unavailable"}
ACTION_PULL = "mirror.pull"
ACTION_YANK = "mirror.yank"
#: The least time between two checks of the upstream's key set (a hostile upstream cannot make every pull one).
ROTATION_CHECK_S = 5.0


class PullRefused(Exception):
    """What the upstream served failed a check (digest, receipt, key): nothing of it is stored or served."""


# -- the filters ------------------------------------------------------------------------------


def wanted(ctx: StoreContext, family: str, sm: str | None) -> bool:
    """Does this mirror pull records of ``family`` (and ``sm``, when known)? ``CGSTORE_MIRROR_FAMILIES``/``_SM``."""
    families, sms = ctx.settings.mirror_family_globs, ctx.settings.mirror_sm_globs
    if families and not any(fnmatchcase(family, glob) for glob in families):
        return False
    return sm is None or not sms or any(fnmatchcase(sm, glob) for glob in sms)


# -- the hooks the routers call ------------------------------------------------------------------


def resolve(ctx: StoreContext, claims: Claims, request: ResolveRequest, urls_for: search.UrlsFor) -> bytes:
    """``search.resolve``; on a mirror, its misses asked of the upstream once and pulled first."""
    if ctx.mirror is None:
        return search.resolve(ctx, claims, request, urls_for)
    answer = search.resolve(ctx, claims, request, urls_for, count=False)
    if b'"status":"miss"' not in answer:  # all hits: nothing to parse
        ctx.metrics.count_resolve(request.family, len(request.keys), 0)
        return answer
    document = json.loads(answer)
    missed = sorted({item["key"] for item in document["answers"] if item["status"] == "miss"})
    pulled, unavailable = 0, False
    if wanted(ctx, request.family, None):
        pulled, unavailable = _pull_keys(ctx, ctx.mirror, claims, request.family, missed)
    if pulled:
        again = search.resolve(ctx, claims, request.model_copy(update={"keys": missed}), urls_for, count=False)
        found = {item["key"]: item for item in json.loads(again)["answers"]}
        document["answers"] = [
            found.get(item["key"], item) if item["status"] == "miss" else item for item in document["answers"]
        ]
    misses = [item for item in document["answers"] if item["status"] == "miss"]
    ctx.metrics.count_resolve(request.family, len(request.keys) - len(misses), len(misses))
    if not pulled and not unavailable:
        return answer
    if unavailable:
        for item in misses:
            item["detail"] = UNAVAILABLE
    return to_json(document)


def discover(ctx: StoreContext, claims: Claims, request: DiscoverRequest, urls_for: search.UrlsFor) -> bytes:
    """``search.discover``; on a mirror, an empty answer asked of the upstream once and its candidates pulled."""
    answer = search.discover(ctx, claims, request, urls_for)
    runtime = ctx.mirror
    if runtime is None or not wanted(ctx, request.family, request.sm):
        return answer
    document = json.loads(answer)
    if document["candidates"]:
        return answer
    _, digest = search.check_declaration(request)
    declaration = request.model_dump(mode="json", exclude={"explain"}, exclude_none=True)
    flight_key = ("discover", digest, json.dumps(declaration, sort_keys=True))
    if flight_key in runtime.negatives:
        return answer

    def ask() -> Any:
        # A flight that ended between this caller's miss and its own flight pulled them already.
        if _held_declaration(ctx, digest):
            return None
        found = _ask(runtime, None, lambda: runtime.upstream.discover(declaration))
        _pull_candidates(ctx, claims, found)  # in the flight: a caller arriving after it finds them held
        return found

    try:
        if not runtime.worth_asking():
            raise UpstreamUnavailable("the upstream is down")
        found = runtime.flights.do(flight_key, ask)
    except UpstreamUnavailable:
        return to_json({**document, "detail": UNAVAILABLE})
    except UpstreamRefused as err:
        log.warning("mirror: the upstream refused a discover: %s", err)
        return answer
    if found is None:
        return search.discover(ctx, claims, request, urls_for)
    if not _pull_candidates(ctx, claims, found):
        runtime.negatives.remember(flight_key)
        return answer
    return search.discover(ctx, claims, request, urls_for)


def _pull_candidates(ctx: StoreContext, claims: Claims, found: Any) -> int:
    """Pull the candidates of an upstream discover that ``claims`` could read here; how many are held now."""
    pulled = 0
    candidates = found.get("candidates") if isinstance(found, dict) else None
    for candidate in candidates if isinstance(candidates, list) else []:
        if not isinstance(candidate, dict):
            continue
        owner, _, name = str(candidate.get("repo", "")).partition("/")
        key = str(candidate.get("key", ""))
        if is_key(key) and _readable(claims, owner, name) and _try_pull(ctx, owner, name, key):
            pulled += 1
    return pulled


def get_record(ctx: StoreContext, claims: Claims, owner: str, repo: str, key: str) -> Record:
    """``records.get_record``; on a mirror, a miss pulled from the upstream first."""
    try:
        return records.get_record(ctx, claims, owner, repo, key)
    except NameUnknown as miss:
        if ctx.mirror is None or not is_key(key) or not _readable(claims, owner, repo):
            raise
        try:
            pulled = _try_pull(ctx, owner, repo, key, raise_unavailable=True)
        except UpstreamUnavailable:
            raise NameUnknown("no such compiled graph", key=key[:120], **UNAVAILABLE) from None
        if not pulled:
            raise miss from None
        return records.get_record(ctx, claims, owner, repo, key)


def locate_blob(ctx: StoreContext, claims: Claims, owner: str, repo: str, digest: str) -> blobs_service.BlobLocation:
    """``blobs.service.locate``; on a mirror, a miss pulled from the upstream first (and bytes served counted)."""
    runtime = ctx.mirror
    try:
        location = blobs_service.locate(ctx, claims, owner, repo, digest)
    except BlobUnknown as miss:
        if runtime is None or not _readable(claims, owner, repo):
            raise
        negative = ("blob", owner, repo, digest)
        if negative in runtime.negatives:
            raise miss from None
        try:
            if not runtime.worth_asking():
                raise UpstreamUnavailable("the upstream is down") from None
            size = _ask(
                runtime, ("blob-size", owner, repo, digest), lambda: runtime.upstream.blob_size(owner, repo, digest)
            )
            if size is None:
                runtime.negatives.remember(negative)
                raise miss from None
            pull_blob(ctx, owner, repo, digest, size, holder=trust.MIRROR_ACTOR)
        except UpstreamUnavailable:
            raise BlobUnknown("blob unknown to this repo", digest=digest, **UNAVAILABLE) from None
        except (PullRefused, UpstreamRefused) as err:
            log.warning("mirror: blob %s of %s/%s refused: %s", digest, owner, repo, err)
            raise miss from None
        location = blobs_service.locate(ctx, claims, owner, repo, digest)
    if runtime is not None:
        runtime.count_served(location.size)
    return location


# -- pulling ------------------------------------------------------------------------------------


def pull_record(ctx: StoreContext, owner: str, repo: str, key: str) -> bool:
    """Pull ``owner/repo``'s record of ``key`` from the upstream, verify it and its blobs, store it unchanged.

    True when the mirror holds it live (now or already); False when the upstream
    has none (remembered briefly) or the filters do not want it. Single-flight
    per record; idempotent. Raises ``PullRefused`` when a check fails (nothing
    stored), ``UpstreamUnavailable`` when the upstream does not answer.
    """
    runtime = ctx.mirror
    if runtime is None:
        return False
    return runtime.flights.do(("record", owner, repo, key), lambda: _pull_record(ctx, runtime, owner, repo, key))


def _pull_record(ctx: StoreContext, runtime: MirrorRuntime, owner: str, repo: str, key: str) -> bool:
    if _held_live(ctx, owner, repo, key):
        return True
    negative = ("record", owner, repo, key)
    if negative in runtime.negatives:
        return False
    if not runtime.worth_asking():
        raise UpstreamUnavailable("the upstream is down")
    document = _ask(runtime, None, lambda: runtime.upstream.record(owner, repo, key))
    if document is None:
        runtime.negatives.remember(negative)
        return False
    record = _parsed(document, owner, repo, key)
    if record.yank is not None or not wanted(ctx, record.manifest.family, record.manifest.axes.sm):
        return False
    try:
        derived = admission.check_manifest(key, record.manifest)
    except StoreError as err:
        raise _refused(ctx, owner, repo, key, f"the record's axes do not derive its key: {err.code}") from None
    kid = _verified(ctx, runtime, document, owner, repo, key)
    blobs = [(record.manifest.artifact.digest, record.manifest.artifact.size)]
    blobs += [(c.digest, c.size) for c in record.manifest.components]
    # A record's blobs cross the far link together: one at a time, a small component's lone first part
    # and the end of each blob leave the link idle (the preheat lag of bench/mirror.py).
    with ThreadPoolExecutor(len(blobs), thread_name_prefix="mirror-pull") as pool:
        pulls = [
            pool.submit(pull_blob, ctx, owner, repo, digest, size, holder=record.publisher.principal)
            for digest, size in blobs
        ]
        for pull in pulls:
            try:
                pull.result()
            except PullRefused as err:
                raise _refused(ctx, owner, repo, key, str(err)) from None
    _store(ctx, runtime, owner, repo, record, derived, kid)
    runtime.count_record()
    return True


def _parsed(document: Any, owner: str, repo: str, key: str) -> Record:
    try:
        record = Record.model_validate(document)
    except ValidationError as err:
        raise PullRefused(f"the upstream's record of {key} is not a record: {err.error_count()} errors") from None
    if record.key != key or record.repo != f"{owner}/{repo}":
        raise PullRefused(f"the upstream answered another record ({record.repo}:{record.key}) for {owner}/{repo}:{key}")
    return record


def _verified(ctx: StoreContext, runtime: MirrorRuntime, document: dict, owner: str, repo: str, key: str) -> str:
    """The kid of the record's receipt, once the trusted upstream keys verify it (following an announced rotation)."""
    keys = trust.trusted_keys(ctx.db)
    if not keys:
        raise _refused(ctx, owner, repo, key, "the mirror trusts no upstream keys yet: run `cgstore mirror trust`")
    try:
        trust.verify(document.get("receipt"), document, keys)
    except ReceiptKeyUnknown:
        if not follow_rotation(ctx):
            raise _refused(ctx, owner, repo, key, "the receipt is signed by a key no trusted key vouches for") from None
        try:
            trust.verify(document.get("receipt"), document, trust.trusted_keys(ctx.db))
        except ReceiptInvalid as err:
            raise _refused(ctx, owner, repo, key, f"receipt refused: {err}") from None
    except ReceiptInvalid as err:
        raise _refused(ctx, owner, repo, key, f"receipt refused: {err}") from None
    return str(jwt.get_unverified_header(document["receipt"]).get("kid"))[:16]


def follow_rotation(ctx: StoreContext) -> bool:
    """Adopt the upstream's new key set if a trusted key announced it; else refuse it and raise the alarm.

    True when the trusted set changed. At most one check per ``ROTATION_CHECK_S``.
    """
    runtime = ctx.mirror
    if runtime is None:
        return False
    return runtime.flights.do(("keys",), lambda: _follow_rotation(ctx, runtime))


def _follow_rotation(ctx: StoreContext, runtime: MirrorRuntime) -> bool:
    if not runtime.rotation_check_due(ROTATION_CHECK_S):
        return False
    url = runtime.upstream.url
    keys = trust.trusted_keys(ctx.db)
    served = _ask(runtime, None, runtime.upstream.jwks)
    statements = _ask(runtime, None, runtime.upstream.key_statements)
    current = trust.fingerprint({"keys": keys})
    try:
        served_fingerprint = trust.fingerprint({"keys": trust.public_keys(served)})
    except Exception:  # a JWKS without usable keys: refused like any unvouched set
        served_fingerprint = "unusable"
    if served_fingerprint == current:
        return False  # nothing rotated: the receipt itself is what is wrong
    announced = trust.announced(statements, keys)
    if announced is not None and trust.fingerprint({"keys": trust.public_keys(announced)}) == served_fingerprint:
        trust.record_trust(ctx.db, url, announced, expect=None, how="rotation announced under a trusted key")
        runtime.alarm = None
        log.warning("mirror: adopted the upstream's rotated keys %s", served_fingerprint)
        return True
    reason = "the upstream serves a key set no trusted key vouches for"
    found = trust.refuse_keys(ctx.db, url, served, reason)
    runtime.alarm = f"{reason} ({found}): refused; check the upstream, then `cgstore mirror trust` if it is genuine"
    ctx.metrics.mirror_alarms.inc()
    log.error("mirror: %s (%s) refused", reason, found)
    return False


def pull_blob(ctx: StoreContext, owner: str, repo: str, digest: str, size: int, *, holder: str) -> None:
    """Bring ``digest`` (``size`` bytes) from the upstream's ``owner/repo`` into storage, verified, and link it
    there locally. Single-flight per digest; a blob already stored is only linked. ``PullRefused`` on bad bytes."""
    runtime = ctx.mirror
    if runtime is None:
        raise PullRefused("not a mirror")
    blobs_service.validate_digest(digest)
    if not _stored_ok(ctx, digest):
        runtime.flights.do(("blob", digest), lambda: _pull_bytes(ctx, runtime, owner, repo, digest, size))
    with ctx.db.session() as session:
        target = _ensure_repo(session, owner, repo)
        _link(session, target, digest, size, holder)


def _pull_bytes(ctx: StoreContext, runtime: MirrorRuntime, owner: str, repo: str, digest: str, size: int) -> None:
    spool = private_dir(ctx.settings.home / "mirror-spool") / digest.partition(":")[2]
    # Processes sharing this home (`CGSTORE_WORKERS`) take turns on a spool file: never two writers.
    with FileLock(f"{spool}.lock"):
        if _stored_ok(ctx, digest):
            return
        _ask(runtime, None, lambda: runtime.upstream.fetch_blob(owner, repo, digest, size, spool))
        try:
            with ctx.storage.writer(digest, size) as writer, open(spool, "rb") as source:
                while chunk := source.read(1 << 20):
                    writer.write(chunk)
                writer.commit()
        except Unavailable:
            raise  # the storage is down: the spool stays, the next pull resumes from it
        except StoreError as err:
            _drop_spool(spool)  # bad bytes must not be resumed from
            raise PullRefused(
                f"blob {digest} from the upstream does not match its digest or size ({err.code})"
            ) from None
        _drop_spool(spool)
    with ctx.db.session() as session:
        now = utcnow()
        if not insert_ignoring_conflicts(session, Blob, digest=digest, size=size, created_at=now, linked_at=now):
            if blobs_service.hold_blobs(session, [digest]):
                # Condemned by GC since the check: it may delete the very bytes just written.
                raise Unavailable("the blob is being garbage-collected: ask again shortly", digest=digest)
            session.execute(update(Blob).where(Blob.digest == digest).values(health=BLOB_OK))
    runtime.count_pulled(size)
    ctx.metrics.mirror_pulled_bytes.inc(size)


def _drop_spool(spool: Path) -> None:
    spool.unlink(missing_ok=True)
    spool.with_name(spool.name + ".parts").unlink(missing_ok=True)


def _stored_ok(ctx: StoreContext, digest: str) -> bool:
    with ctx.db.session() as session:
        row = session.get(Blob, digest)
        return row is not None and row.health == BLOB_OK and row.collecting_since is None


def _ensure_repo(session, owner: str, repo: str) -> Repo:
    target = find_repo(session, owner, repo)
    if target is None:
        insert_ignoring_conflicts(
            session,
            Repo,
            owner=owner,
            name=repo,
            visibility="owner",
            created_by=trust.MIRROR_ACTOR,
            created_at=utcnow(),
        )
        target = find_repo(session, owner, repo)
    assert target is not None
    return target


def _link(session, target: Repo, digest: str, size: int, holder: str) -> None:
    if blobs_service.hold_blobs(session, [digest]):
        raise Unavailable("the blob is being garbage-collected: ask again shortly", digest=digest)
    insert_ignoring_conflicts(
        session, RepoBlob, repo_id=target.id, digest=digest, linked_by=trust.MIRROR_ACTOR, created_at=utcnow()
    )
    insert_ignoring_conflicts(
        session, RepoBlobHolder, repo_id=target.id, digest=digest, principal=holder, created_at=utcnow()
    )


def _store(
    ctx: StoreContext,
    runtime: MirrorRuntime,
    owner: str,
    repo: str,
    record: Record,
    derived: admission.Derived,
    kid: str,
) -> None:
    """Write the verified record (receipt unchanged, ``origin`` the upstream), with its components, audit entry
    and feed event, in one transaction; a record already held live is left as it is."""
    manifest = record.manifest
    components = [(c.name, c.digest, c.size) for c in manifest.components]
    layout = manifest.layout
    values = dict(
        key=record.key,
        kind=manifest.kind,
        format=manifest.format,
        family=manifest.family,
        lane=manifest.lane,
        sm=manifest.axes.sm,
        graph_digest=manifest.axes.graph,
        envelope=derived.envelope.document,
        envelope_digest=derived.envelope.digest,
        toolchain=derived.toolchain.document,
        toolchain_digest=derived.toolchain.digest,
        recorded_versions=dict(derived.toolchain.recorded),
        artifact_digest=manifest.artifact.digest,
        artifact_size=manifest.artifact.size,
        component_set=admission.component_set_digest(components),
        layout_display=layout.display if layout else None,
        layout_topology=layout.topology if layout else None,
        layout_quant=layout.quant if layout else None,
        input_contract=record.input_contract,
        binding_table=[binding.model_dump(mode="json") for binding in record.binding_table],
        kernel_lane=record.kernel_lane,
        kernel_lane_evidence=manifest.evidence.kernel_lane_evidence,
        mint_phases=manifest.evidence.mint_phases,
        publisher=record.publisher.principal,
        publisher_jti=record.publisher.jti,
        scope="",
        created_at=record.created_at,
        health=HEALTH_OK,
        receipt=record.receipt,
        receipt_kid=kid,
        discovery_digest=admission.discovery_of(manifest.family, manifest.axes.sm, derived),
        binding_signature=record.binding_signature,
        release=manifest.release,
        code_fingerprint=manifest.code,
        drift_reports=0,
        origin=runtime.upstream.url,
    )
    with ctx.db.session() as session:
        target = _ensure_repo(session, owner, repo)
        for digest, size in [(manifest.artifact.digest, manifest.artifact.size), *((d, s) for _, d, s in components)]:
            _link(session, target, digest, size, record.publisher.principal)
        if not insert_ignoring_conflicts(session, CompiledGraph, repo_id=target.id, **values):
            return  # another replica (or an earlier pull) stored it first
        row = session.scalar(live_query(target.id, record.key).where(CompiledGraph.scope == ""))
        session.add_all(
            CompiledGraphComponent(record_id=row.id, name=name, digest=digest, size=size)
            for name, digest, size in components
        )
        _audit(
            session,
            ACTION_PULL,
            owner,
            repo,
            record.key,
            upstream=runtime.upstream.url,
            artifact=manifest.artifact.digest,
            bytes=manifest.artifact.size + sum(size for _, _, size in components),
            receipt_kid=kid,
        )
        events.published(session, ctx.feed, target, row)  # the feed's lock: last, after the audit's


def apply_yank(ctx: StoreContext, owner: str, repo: str, key: str, reason: str) -> bool:
    """Yank the mirror's live copies of ``owner/repo``'s ``key`` (an upstream yank), writing the mirror's own
    audit entry and feed event so its workers' watchers see it. False when the mirror holds none."""
    with ctx.db.session() as session:
        target = find_repo(session, owner, repo)
        if target is None:
            return False
        rows = list(session.scalars(live_query(target.id, key)))
        if not rows:
            return False
        now, reason = utcnow(), reason[:1000]
        # The follower and a pull's check may yank the same row at once: only a row still live when its update
        # runs (PostgreSQL re-reads it after the other's commit) is yanked, audited and told on the feed.
        rows = [row for row in rows if _yank_row(session, row, now, reason)]
        if not rows:
            return False
        _audit(session, ACTION_YANK, owner, repo, key, reason=reason, upstream=ctx.settings.upstream_url)
        for row in rows:
            events.yanked(session, ctx.feed, target, row, reason)
    if ctx.mirror is not None:
        ctx.mirror.negatives.forget(("record", owner, repo, key))
    return True


# -- helpers ------------------------------------------------------------------------------------


def _audit(session, action: str, owner: str, repo: str, key: str, *, outcome: str = "ok", **detail: object) -> None:
    """The mirror's own audit entry of ``action`` on ``owner/repo``'s record of ``key``."""
    audit(
        session,
        actor=trust.MIRROR_ACTOR,
        jti=None,
        action=action,
        target=f"{owner}/{repo}:{key}",
        repo=f"{owner}/{repo}",
        outcome=outcome,
        detail=detail,
    )


def _yank_row(session, row: CompiledGraph, now, reason: str) -> bool:
    """Yank ``row`` if it is still live; whether this call did."""
    done = session.execute(
        update(CompiledGraph)
        .where(CompiledGraph.id == row.id, CompiledGraph.yanked_at.is_(None))
        .values(yanked_at=now, yanked_by=trust.MIRROR_ACTOR, yank_reason=reason)
    )
    if done.rowcount != 1:
        return False
    row.yanked_at, row.yanked_by, row.yank_reason = now, trust.MIRROR_ACTOR, reason
    return True


def _readable(claims: Claims, owner: str, repo: str) -> bool:
    """May the caller read ``owner/repo`` here (names checked first: only well-formed ones reach the upstream)?"""
    return is_valid_owner(owner) and is_valid_repo(repo) and access.can_read(claims, owner, repo).allowed


def _held_keys(ctx: StoreContext, family: str, keys: list[str]) -> set[str]:
    """Which of ``keys`` (of ``family``) the mirror holds live, pulled from the upstream."""
    with ctx.db.session() as session:
        return set(
            session.scalars(
                select(CompiledGraph.key).where(
                    CompiledGraph.key.in_(keys),
                    CompiledGraph.family == family,
                    CompiledGraph.yanked_at.is_(None),
                    CompiledGraph.origin.is_not(None),
                )
            )
        )


def _held_declaration(ctx: StoreContext, digest: str) -> bool:
    """Does the mirror hold a live record pulled from the upstream with this discovery digest?"""
    with ctx.db.session() as session:
        found = select(CompiledGraph.id).where(
            CompiledGraph.discovery_digest == digest,
            CompiledGraph.yanked_at.is_(None),
            CompiledGraph.origin.is_not(None),
        )
        return session.scalar(found.limit(1)) is not None


def _held_live(ctx: StoreContext, owner: str, repo: str, key: str) -> bool:
    with ctx.db.session() as session:
        target = find_repo(session, owner, repo)
        return target is not None and session.scalar(live_query(target.id, key).limit(1)) is not None


def _ask(runtime: MirrorRuntime, flight_key, call):
    """One upstream call (shared by concurrent askers under ``flight_key``), its reachability recorded."""

    def asked():
        try:
            answer = call()
        except UpstreamUnavailable as err:
            runtime.failed(str(err))
            raise
        runtime.answered()
        return answer

    return asked() if flight_key is None else runtime.flights.do(flight_key, asked)


def _try_pull(ctx: StoreContext, owner: str, repo: str, key: str, *, raise_unavailable: bool = False) -> bool:
    """``pull_record``, a refusal or a refused token answered as "not pulled"; unavailability too unless asked."""
    try:
        return pull_record(ctx, owner, repo, key)
    except PullRefused:
        # Not asked again for a while: a hostile upstream cannot make every read a new pull of its bytes.
        if ctx.mirror is not None:
            ctx.mirror.negatives.remember(("record", owner, repo, key))
        return False
    except UpstreamRefused as err:
        log.warning("mirror: the upstream refused the pull of %s/%s:%s: %s", owner, repo, key, err)
        return False
    except UpstreamUnavailable:
        if raise_unavailable:
            raise
        return False


def _pull_keys(
    ctx: StoreContext, runtime: MirrorRuntime, claims: Claims, family: str, keys: list[str]
) -> tuple[int, bool]:
    """Ask the upstream to resolve the missed ``keys`` once; pull the hits the caller could read here.
    (How many were pulled, whether the upstream was unavailable.)"""
    asked = [key for key in keys if ("key", family, key) not in runtime.negatives]
    if not asked:
        return 0, False
    if not runtime.worth_asking():
        return 0, True

    def ask() -> tuple[int, Any]:
        # A flight that ended between this caller's miss and its own flight pulled them already.
        held = _held_keys(ctx, family, asked)
        remaining = [key for key in asked if key not in held]
        found = _ask(runtime, None, lambda: runtime.upstream.resolve(family, remaining)) if remaining else {}
        # The first caller pulls in the flight, so that a caller arriving after it finds them held.
        _pull_hits(ctx, runtime, claims, family, asked, found)
        return len(held), found

    try:
        held, found = runtime.flights.do(("resolve", family, tuple(asked)), ask)
    except UpstreamUnavailable:
        return 0, True
    except UpstreamRefused as err:
        log.warning("mirror: the upstream refused a resolve: %s", err)
        return 0, False
    pulled, unavailable = _pull_hits(ctx, runtime, claims, family, asked, found)
    return held + pulled, unavailable


def _pull_hits(
    ctx: StoreContext, runtime: MirrorRuntime, claims: Claims, family: str, asked: list[str], found: Any
) -> tuple[int, bool]:
    """Pull the hits of an upstream resolve that ``claims`` could read here (already held: counted, not pulled
    again); remember its misses. (How many are held now, whether the upstream was unavailable.)"""
    pulled, unavailable = 0, False
    for item in _answers(found):
        key = str(item.get("key", ""))
        if key not in asked:
            continue  # only what was asked
        if item.get("status") != "hit":
            runtime.negatives.remember(("key", family, key))
            continue
        owner, _, name = str(item.get("repo", "")).partition("/")
        if not _readable(claims, owner, name):
            continue  # pulled only for a caller who could read it here
        try:
            pulled += _try_pull(ctx, owner, name, key, raise_unavailable=True)
        except UpstreamUnavailable:
            unavailable = True
    return pulled, unavailable


def _answers(found: Any) -> Iterable[dict]:
    answers = found.get("answers") if isinstance(found, dict) else None
    return [item for item in answers if isinstance(item, dict)] if isinstance(answers, list) else []


def _refused(ctx: StoreContext, owner: str, repo: str, key: str, reason: str) -> PullRefused:
    """A refused pull, audited and counted (the upstream token never in it: the reason is the mirror's own words)."""
    log.error("mirror: refused %s/%s:%s from the upstream: %s", owner, repo, key, reason)
    ctx.metrics.mirror_pulls_refused.inc()
    try:
        with ctx.db.session() as session:
            _audit(
                session,
                ACTION_PULL,
                owner,
                repo,
                key,
                outcome="refused",
                reason=reason[:300],
                upstream=ctx.settings.upstream_url,
            )
    except Exception:  # the refusal stands even if it cannot be audited
        log.exception("mirror: could not audit a refused pull")
    return PullRefused(reason)


# -- state ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MirrorStatus:
    """What ``/healthz``, the metrics and the console show of a mirror (never its token)."""

    upstream: str
    reachable: bool | None
    last_contact: float | None
    last_error: str | None
    alarm: str | None
    trusted_fingerprint: str | None
    bytes_pulled: int
    bytes_served: int
    records_pulled: int

    @property
    def degraded(self) -> bool:
        return self.reachable is False or self.alarm is not None or self.trusted_fingerprint is None


def state(ctx: StoreContext) -> MirrorStatus | None:
    """The mirror's status (None on a store that is not a mirror)."""
    runtime = ctx.mirror
    if runtime is None:
        return None
    try:
        with ctx.db.session() as session:
            found = trust.trusted(session)
        fingerprint = found["fingerprint"] if found else None
    except Exception:  # the database is down: /readyz says so; the fingerprint is unknown
        fingerprint = None
    return MirrorStatus(
        upstream=runtime.upstream.url,
        reachable=runtime.reachable,
        last_contact=runtime.last_contact,
        last_error=runtime.last_error,
        alarm=runtime.alarm,
        trusted_fingerprint=fingerprint,
        bytes_pulled=runtime.bytes_pulled,
        bytes_served=runtime.bytes_served,
        records_pulled=runtime.records_pulled,
    )


def probe(ctx: StoreContext, max_age_s: float = 5.0) -> None:
    """Ask the upstream's ``/healthz`` if nothing was heard from it for ``max_age_s`` (bounded by the timeout)."""
    runtime = ctx.mirror
    if runtime is None or not runtime.contact_stale(max_age_s):
        return
    try:
        _ask(runtime, ("ping",), runtime.upstream.ping)
    except (UpstreamUnavailable, UpstreamRefused):
        pass


def mirrored_rows(ctx: StoreContext, limit: int = 1000) -> list[tuple[str, str, str]]:
    """``(owner, repo, key)`` of live mirrored records (oldest first, at most ``limit``): what a resync re-checks."""
    with ctx.db.session() as session:
        rows = session.execute(
            select(Repo.owner, Repo.name, CompiledGraph.key)
            .join(Repo, Repo.id == CompiledGraph.repo_id)
            .where(CompiledGraph.origin.is_not(None), CompiledGraph.yanked_at.is_(None))
            .order_by(CompiledGraph.id)
            .limit(limit)
        ).all()
    return [tuple(row) for row in rows]
