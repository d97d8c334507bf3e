"""``Client``: the worker's and the mint child's face of the store.

Configuration comes from the arguments or the environment: ``CGSTORE_URL``,
``CGSTORE_TOKEN`` (or ``CGSTORE_TOKEN_FILE``), ``CGSTORE_CACHE_DIR`` (default
``~/.cache/cgstore``), ``CGSTORE_OFFLINE``, ``CGSTORE_DOWNLOAD_CONNECTIONS`` /
``CGSTORE_DOWNLOAD_PART_BYTES`` (parallel ranged downloads, ``download.py``), the bounds of
``limits.py`` (deadlines, throughput, sizes), ``CGSTORE_TRUSTED_JWKS`` (the keys receipts
must be signed with, ``receipts.TrustPin``) and ``CGSTORE_WRITE_URL`` with ``CGSTORE_WRITE_TOKEN``
(or ``CGSTORE_WRITE_TOKEN_FILE``): where writes go when reads go to a regional mirror, which
refuses them (uploads, publishes, claims and their beats, drift reports go to the origin store;
everything else stays on ``CGSTORE_URL``). In offline mode no socket is ever
opened: the transport is created on first network use, and offline it never is.

Where a request goes is the client's choice, never an answer's: a record is read at
:func:`record_path` (built from its repo and key, whatever ``href`` the answer carries)
and the transport sends nothing off the store's origin.

Blob primitives live here: :meth:`Client.fetch_blob` (verified download into the
cache, through which every other download goes; the transfer itself is ``download.py``) and :meth:`Client.push_blobs`
(batch missing check, then monolithic or resumable chunked uploads). On top of
them: :meth:`Client.load` (a worker's boot: one resolve, verified downloads,
``Loaded`` or ``Eager`` per want) and :meth:`Client.publish` (a mint child's
idempotent publish of an archive and its components).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgstore_client.archive import inspect
from cgstore_client.errors import (
    CgstoreError,
    CompiledRequired,
    ConfigError,
    IntegrityError,
    NotFound,
    Offline,
    Refused,
    Unavailable,
)
from cgstore_client.keys import Envelope, Toolchain, ck1, validate_digest
from cgstore_client.lanes import DEFAULT_LANE, resolve_lane
from cgstore_client.limits import Limits
from cgstore_client.receipts import (
    ReceiptInvalid,
    ReceiptKeyUnknown,
    ReceiptVerifier,
    TrustPin,
    proves_root,
    verify_jws_receipt,
)
from cgstore_client.wire.discovery import DEFAULT_DISCOVER_LIMIT, Candidate
from cgstore_client.wire.fleet import MAX_EVENTS_WAIT_S
from cgstore_client.wire.records import Manifest, PublishAnswer, Record, ResolveAnswer, ResolveHit, ResolveRequest
from cgstore_client.worker import outcomes
from cgstore_client.worker.cache import Cache, hash_file
from cgstore_client.worker.download import (
    BUFFER_BYTES,
    DEFAULT_CONNECTIONS,
    DEFAULT_PART_BYTES,
    Plan,
    Progress,
    Slots,
    download,
)
from cgstore_client.worker.http import Retry, Transport, file_chunks, parse_answer, record_path, split_repo, store_path
from cgstore_client.worker.outcomes import Eager, Loaded, Want

if TYPE_CHECKING:  # pragma: no cover - typing only
    from cgstore_client.worker.discovery import Booted
    from cgstore_client.worker.fleet import Watcher

DEFAULT_URL = "http://127.0.0.1:8080"  # where `make serve` listens
#: Blobs at least this large go through a resumable upload session rather than one PUT.
CHUNKED_THRESHOLD = 64 << 20
#: One PATCH of a session: what a killed publish can lose, and the stride at which a
#: session's bytes wait for each other. The store stages a chunk as parts of the session's
#: multipart upload (16 MiB each by default), several in flight while the chunk streams in,
#: but a chunk is answered only once all its parts are in: 16 MiB chunks sent one part at a
#: time (~50 MiB/s per session on RGW, bench/README.md "client.py"). A multiple of the
#: store's part size, so every part is whole.
CHUNK_BYTES = 64 << 20
#: Bound on blobs moving at once (uploads in a publish, downloads in a load).
PARALLEL_TRANSFERS = 4
MAX_MISSING_BATCH = 1024
#: The component name under which ``publish`` uploads the mint's derived constants.
DERIVED_COMPONENT = "derived-constants"
_TRUE = frozenset({"1", "true", "yes", "on"})


def _token_from_env(variable: str = "CGSTORE_TOKEN") -> str | None:
    """The token of ``variable``, else the contents of the file ``<variable>_FILE`` names, else None."""
    if token := os.environ.get(variable):
        return token.strip()
    if path := os.environ.get(f"{variable}_FILE"):
        try:
            return Path(path).read_text().strip()
        except OSError as err:
            raise ConfigError(f"{variable}_FILE {path!r} is unreadable: {err}") from err
    return None


def _positive(env: str, value: int | None, default: int) -> int:
    """A count setting: the argument, else the environment variable ``env``, else ``default``."""
    if value is None:
        raw = os.environ.get(env, "").strip()
        try:
            value = int(raw) if raw else default
        except ValueError:
            raise ConfigError(f"{env} must be a whole number, not {raw!r}") from None
    if value < 1:
        raise ConfigError(f"{env} must be at least 1, not {value}")
    return value


class Client:
    """The store, from a worker's or a mint child's side. Use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        offline: bool | None = None,
        retry: Retry | None = None,
        receipt_verifier: ReceiptVerifier = verify_jws_receipt,
        chunked_threshold: int | None = None,
        download_connections: int | None = None,
        download_part_bytes: int | None = None,
        limits: Limits | None = None,
        trusted_jwks: object = None,
        events_wait_s: float = MAX_EVENTS_WAIT_S,
        write_url: str | None = None,
        write_token: str | None = None,
    ) -> None:
        """``limits``: deadlines, throughput and size bounds (default: ``Limits.from_env()``).
        ``trusted_jwks``: pin the keys receipts may be signed with (``receipts.TrustPin.parse``: a JWKS,
        a JWKS file's path, or RFC 7638 thumbprints; default ``CGSTORE_TRUSTED_JWKS``, else the store's JWKS).
        ``events_wait_s``: how long one long-poll of the events feed waits (≤ 30; a yank reaches a handle
        within it and a second).
        ``write_url``, ``write_token``: the store that takes this client's writes (default
        ``CGSTORE_WRITE_URL``, ``CGSTORE_WRITE_TOKEN``/``_FILE``; unset: ``url`` and ``token``). A worker
        reading through a regional mirror claims and publishes at the mirror's upstream, so one mint
        serves every region; each token only ever goes to its own store's origin."""
        self.url = (url or os.environ.get("CGSTORE_URL") or DEFAULT_URL).rstrip("/")
        self.token = token if token is not None else _token_from_env()
        write_url = write_url or os.environ.get("CGSTORE_WRITE_URL", "").strip() or None
        self.write_url = write_url.rstrip("/") if write_url else self.url
        if write_token is None:
            write_token = _token_from_env("CGSTORE_WRITE_TOKEN") if write_url else self.token
        self.write_token = write_token
        self.offline = offline if offline is not None else os.environ.get("CGSTORE_OFFLINE", "").lower() in _TRUE
        self.cache = Cache(cache_dir)
        self.cache.ensure()
        self.retry = retry or Retry()
        self.receipt_verifier = receipt_verifier
        self.limits = limits if limits is not None else Limits.from_env()
        self.trust = TrustPin.parse(
            trusted_jwks if trusted_jwks is not None else os.environ.get("CGSTORE_TRUSTED_JWKS", "").strip() or None
        )
        self.chunked_threshold = CHUNKED_THRESHOLD if chunked_threshold is None else chunked_threshold
        connections = _positive("CGSTORE_DOWNLOAD_CONNECTIONS", download_connections, DEFAULT_CONNECTIONS)
        part_bytes = _positive("CGSTORE_DOWNLOAD_PART_BYTES", download_part_bytes, DEFAULT_PART_BYTES)
        # A buffer larger than a part would never be filled by a part: memory for nothing.
        slots = Slots(connections, min(BUFFER_BYTES, part_bytes))
        self.downloads = Plan(slots, part_bytes, self.retry, self.cache, self.limits)
        self._transport: Transport | None = None
        self._writer: Transport | None = None
        self._jwks: dict | None = None
        self.events_wait_s = events_wait_s
        self.closed = False
        self._watcher: Watcher | None = None
        self._watcher_lock = threading.Lock()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections. The events watcher's long-poll is cut and its thread has ended (bounded
        wait) when this returns: a closed client sends nothing more."""
        self.closed = True
        if self._watcher is not None:
            self._watcher.stop()
        for transport in (self._transport, self._writer):
            if transport is not None:
                transport.close()

    @property
    def watcher(self) -> Watcher:
        """The one follower of the events feed for this client's handles (``worker.fleet.Watcher``), made on first use."""
        with self._watcher_lock:
            if self._watcher is None:
                from cgstore_client.worker.fleet import Watcher

                self._watcher = Watcher(self, self.events_wait_s)
            return self._watcher

    @property
    def transport(self) -> Transport:
        """The API transport, created on first use; never in offline mode."""
        if self.offline:
            raise Offline("offline mode: the store is not contacted")
        if self._transport is None:
            self._transport = Transport(self.url, self.token, retry=self.retry, limits=self.limits)
        return self._transport

    @property
    def writer(self) -> Transport:
        """The transport of writes (uploads, publishes, claims, reports): ``transport`` itself unless
        ``write_url`` names another store."""
        if self.write_url == self.url and self.write_token == self.token:
            return self.transport
        if self.offline:
            raise Offline("offline mode: the store is not contacted")
        if self._writer is None:
            self._writer = Transport(self.write_url, self.write_token, retry=self.retry, limits=self.limits)
        return self._writer

    # --- download ----------------------------------------------------------------------

    def fetch_blob(self, repo: str, digest: str, size: int | None = None, *, progress: Progress | None = None) -> Path:
        """The verified local path of ``repo``'s blob ``digest``, downloading it if the cache lacks it."""
        owner, name = split_repo(repo)
        validate_digest(digest)
        if cached := self.cache.verified(digest, size):
            return cached
        if self.offline:
            raise Offline(f"offline mode and {digest} is not in the cache")
        with self.cache.lock(digest):
            # Another process may have finished it while we waited for the lock.
            if cached := self.cache.verified(digest, size):
                return cached
            self.cache.sweep_temps()
            if size is not None:
                self.cache.require_space(size)
            url = self.url + store_path("v1", "repos", owner, name, "blobs", digest)
            return self._download(url, digest, size, progress)

    def _download(self, url: str, digest: str, size: int | None, progress: Progress | None) -> Path:
        temp = self.cache.temp_file(digest)
        try:
            with open(temp, "w+b") as out:  # read back: the hash follows the parts
                actual, got = download(self.downloads, url, self.token, size, out, progress)
                out.flush()
                os.fsync(out.fileno())
            if actual != digest or (size is not None and got != size):
                raise IntegrityError(f"downloaded {got} bytes hashing to {actual}, expected {digest} ({size} bytes)")
            return self.cache.commit(temp, digest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()

    # --- upload ------------------------------------------------------------------------

    def missing(self, repo: str, digests: Iterable[str]) -> list[str]:
        """The digests ``repo`` does not hold yet (one call per 1024)."""
        owner, name = split_repo(repo)
        wanted = list(dict.fromkeys(digests))
        missing: list[str] = []
        for i in range(0, len(wanted), MAX_MISSING_BATCH):
            batch = wanted[i : i + MAX_MISSING_BATCH]
            answer = self.writer.request("POST", f"/v1/repos/{owner}/{name}/blobs:missing", json={"digests": batch})
            missing += answer.json()["missing"]
        return missing

    def push_blobs(self, repo: str, paths: Iterable[str | os.PathLike[str]]) -> dict[str, tuple[str, int]]:
        """Upload the files ``repo`` lacks (batch check first, bounded parallel); returns path → (digest, size)."""
        hashed = {str(p): hash_file(p) for p in paths}
        lacking = set(self.missing(repo, [d for d, _ in hashed.values()]))
        todo = {d: (p, s) for p, (d, s) in hashed.items() if d in lacking}
        with ThreadPoolExecutor(PARALLEL_TRANSFERS) as pool:
            for future in [pool.submit(self.upload_blob, repo, p, digest=d, size=s) for d, (p, s) in todo.items()]:
                future.result()
        return hashed

    def upload_blob(
        self, repo: str, path: str | os.PathLike[str], *, digest: str | None = None, size: int | None = None
    ) -> str:
        """Upload one file as a blob of ``repo``; resumable from ``chunked_threshold`` bytes. Returns its digest."""
        owner, name = split_repo(repo)
        if digest is None or size is None:
            digest, size = hash_file(path)
        path = str(path)
        if size < self.chunked_threshold:
            self.writer.request(
                "PUT",
                f"/v1/repos/{owner}/{name}/blobs/{digest}",
                headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
                body=lambda: file_chunks(path, 0, size),
            )
        else:
            self._upload_session(owner, name, path, digest, size)
        return digest

    def _upload_session(self, owner: str, name: str, path: str, digest: str, size: int) -> None:
        opened = self.writer.request("POST", f"/v1/repos/{owner}/{name}/uploads")
        location = opened.headers["Location"]
        offset, failures = 0, 0
        while offset < size:
            end = min(offset + CHUNK_BYTES, size)
            try:
                offset = self._send_chunk(location, path, offset, end)
                failures = 0
            except Unavailable as err:
                failures += 1
                if failures >= self.retry.attempts:
                    raise
                time.sleep(self.retry.delay(failures, err.retry_after_s))
                offset = self._session_offset(location)  # what the store kept of the lost chunk
            except Refused as err:
                if err.code != "RANGE_INVALID":
                    raise
                offset = self._session_offset(location)
        self._commit_session(owner, name, location, digest)

    def _send_chunk(self, location: str, path: str, start: int, end: int) -> int:
        answer = self.writer.request(
            "PATCH",
            location,
            headers={
                "Content-Range": f"{start}-{end - 1}",
                "Content-Length": str(end - start),
                "Content-Type": "application/octet-stream",
            },
            body=lambda: file_chunks(path, start, end),
            retry=False,  # a lost chunk is resumed from the store's offset, not re-sent blindly
        )
        return int(answer.headers["Upload-Offset"])

    def _session_offset(self, location: str) -> int:
        return int(self.writer.request("GET", location).headers["Upload-Offset"])

    def _commit_session(self, owner: str, name: str, location: str, digest: str) -> None:
        try:
            self.writer.request("PUT", location, params={"digest": digest}, headers={"Content-Length": "0"})
        except NotFound:
            # A commit whose answer was lost consumed the session; the blob is there if it landed.
            if not self.has_blob(f"{owner}/{name}", digest):
                raise

    def has_blob(self, repo: str, digest: str) -> bool:
        owner, name = split_repo(repo)
        try:
            self.writer.request("HEAD", f"/v1/repos/{owner}/{name}/blobs/{digest}")
        except NotFound:
            return False
        return True

    # --- mint side -----------------------------------------------------------------------

    def preflight(self, repo: str, min_ttl_s: int = 300) -> None:
        """Raise (``Unauthorized``/``Denied``) unless this token could publish to ``repo`` now and for ``min_ttl_s``."""
        owner, name = split_repo(repo)
        self.writer.request("POST", f"/v1/repos/{owner}/{name}/preflight", params={"min_ttl_s": min_ttl_s})

    # --- boot --------------------------------------------------------------------------

    def resolve(self, family: str, keys: list[str]) -> list[dict[str, Any]]:
        """The store's answer for each key, in order: a hit entry, or ``{"key", "status": "miss"}``."""
        query = ResolveRequest(family=family, keys=keys).model_dump(mode="json")
        body = self.transport.request("POST", "/v1/compiled-graphs:resolve", json=query)
        answers = [_entry(answer) for answer in _answers(body.content)]
        if [a["key"] for a in answers] != list(keys):
            raise Refused("the resolve answer does not answer the keys asked, in order")
        return answers

    def load(
        self, family: str, wants: Iterable[Want | str], *, device_total_bytes: int | None = None
    ) -> list[Loaded | Eager]:
        """Boot: one resolve, verified parallel downloads; ``Loaded`` or ``Eager`` per want, in order.

        Raises :class:`CompiledRequired` (before any GPU work) when a mandatory want
        cannot be served compiled. Offline, answers from the cache alone.
        """
        wants = [w if isinstance(w, Want) else Want(w) for w in wants]
        entries = self._entries(family, [w.key for w in wants])
        trusted = {w.key: self._trusted(entries[w.key], root_only=w.root_only) for w in wants}
        fetched = self._fetch_all([e for e in trusted.values() if isinstance(e, dict)])
        results = [self._serve(w.key, trusted[w.key], fetched, device_total_bytes) for w in wants]
        refused = {w.key: r.reason for w, r in zip(wants, results, strict=True) if w.mandatory and isinstance(r, Eager)}
        if refused:
            raise CompiledRequired(refused)
        return results

    def _entries(self, family: str, keys: list[str]) -> dict[str, dict[str, Any] | str]:
        """key -> hit entry, or why there is none. Offline (or with the store down) from the cache."""
        if self.offline:
            return {
                k: self.cache.read_record(k) or f"{outcomes.OFFLINE_NOT_CACHED}: offline mode, no socket opened"
                for k in keys
            }
        try:
            answers = self.resolve(family, keys)
        except Unavailable as err:
            return {k: self.cache.read_record(k) or outcomes.reason_for(err) for k in keys}
        return {
            a["key"]: self._with_cached_record(a) if a.get("status") == "hit" else outcomes.exact_miss(family, a["key"])
            for a in answers
        }

    def serve_hit(self, hit: ResolveHit) -> Loaded | Eager:
        """One hit (a discover candidate is one) through ``load``'s verified path: its receipt (any
        repo, not only root), the cached or fetched full record, verified downloads."""
        entry = self._trusted(self._with_cached_record(_entry(hit)), root_only=False)
        if isinstance(entry, str):
            return Eager(hit.key, entry)
        return self._serve(hit.key, entry, self._fetch_all([entry]), None)

    def read_record(self, repo: str, key: str) -> dict[str, Any]:
        """The full record of ``repo``'s ``key`` (``wire.records.Record``) as the store answers it now."""
        return _record(self.transport.request("GET", record_path(repo, key)).content)

    def _with_cached_record(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Reuse the cached full record when it is the one resolved (records are write-once): no GET on a warm boot."""
        cached = self.cache.read_record(entry["key"]) or {}
        same = all(cached.get(field) == entry[field] for field in ("repo", "artifact", "components"))
        return {**entry, "record": cached["record"]} if same and "record" in cached else entry

    def _trusted(self, entry: dict[str, Any] | str, *, root_only: bool) -> dict[str, Any] | str:
        """The entry if its receipt verifies (and, ``root_only``, proves a root record), else why it is not trusted."""
        if isinstance(entry, str):
            return entry
        receipt = entry.get("receipt")
        if receipt is None:
            return f"{outcomes.RECEIPT_INVALID}: the record carries no receipt"
        try:
            try:
                claims = self.receipt_verifier(entry, receipt, self.jwks())
            except ReceiptKeyUnknown:
                if self.offline:
                    raise
                # A key rotated in after this client fetched the JWKS: fetch it again, once.
                claims = self.receipt_verifier(entry, receipt, self.jwks(refresh=True))
        except ReceiptInvalid as err:
            return f"{outcomes.RECEIPT_INVALID}: {self._untrusted_signer(receipt) or err}"
        if root_only and not proves_root(claims):
            return f"{outcomes.NOT_ROOT}: the receipt of {entry.get('repo')}'s record does not prove a platform record"
        return entry

    def _untrusted_signer(self, receipt: object) -> str | None:
        """Say so when the receipt's key is the store's but the trust pin does not list it."""
        if self.trust is None or not isinstance(receipt, str):
            return None
        import jwt

        try:
            kid = jwt.get_unverified_header(receipt).get("kid")
        except jwt.PyJWTError:
            return None
        if any(jwk.get("kid") == kid for jwk in (self._jwks or {}).get("keys") or []):
            return f"receipt signed by the store's key {kid!r}, which {self.trust} does not trust"
        return None

    def jwks(self, *, refresh: bool = False) -> dict[str, Any]:
        """The keys receipts verify against: the store's JWKS, fetched once (again with ``refresh``) and
        kept in the cache for offline verification, narrowed to :attr:`trust`'s keys when a pin is set."""
        if self._jwks is None or (refresh and not self.offline):
            cached = self.cache.root / "keys.json"
            if self.offline:
                self._jwks = self.cache.read_json(cached) or {"keys": []}
            else:
                try:
                    self._jwks = self.transport.request("GET", "/v1/keys").json()
                except Unavailable:
                    # The store is down: the cached JWKS still verifies what the cache holds.
                    self._jwks = self.cache.read_json(cached)
                    if self._jwks is None:
                        raise
                else:
                    self.cache.write_json(cached, self._jwks)
        return self.trust.narrow(self._jwks) if self.trust is not None else self._jwks

    def _fetch_all(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """Every blob (digest -> path) and every full record not cached yet (key -> record), in parallel.

        A failed task maps to its error. The pool is bounded; blobs shared by
        several entries are fetched once.
        """
        tasks: dict[str, Callable[[], Any]] = {}
        for entry in entries:
            for blob in [entry["artifact"], *entry["components"]]:
                tasks[blob["digest"]] = lambda e=entry, b=blob: self.fetch_blob(e["repo"], b["digest"], b.get("size"))
            if "record" not in entry:
                # Read where the client says records are: an answer's href could name any host.
                tasks[entry["key"]] = lambda e=entry: _record(
                    self.transport.request("GET", record_path(e["repo"], e["key"])).content
                )

        def run(name: str) -> Any:
            try:
                return tasks[name]()
            except (IntegrityError, Offline, NotFound, Unavailable) as err:
                return err

        with ThreadPoolExecutor(PARALLEL_TRANSFERS) as pool:
            return dict(zip(tasks, pool.map(run, tasks), strict=True))

    def _serve(self, key: str, entry, fetched: dict[str, Any], device_total_bytes: int | None) -> Loaded | Eager:
        if isinstance(entry, str):
            return Eager(key, entry)
        record = entry.get("record", fetched.get(key))
        artifact = fetched[entry["artifact"]["digest"]]
        components = {c["name"]: fetched[c["digest"]] for c in entry["components"]}
        failed = [p for p in (record, artifact, *components.values()) if isinstance(p, CgstoreError)]
        if failed:
            return Eager(key, outcomes.reason_for(failed[0]))
        entry = {**entry, "record": record}
        self.cache.write_record(key, entry)
        lane = resolve_lane(inspect(artifact).metadata, device_total_bytes) if device_total_bytes is not None else None
        return Loaded(
            key=key,
            artifact_path=artifact,
            component_paths=components,
            record=record,
            repo=entry["repo"],
            lane=lane.lane if lane else None,
            lane_reason=lane.reason if lane else None,
            receipt=entry.get("receipt"),
        )

    # --- boot by declaration (cgstore_client.worker.discovery) ------------------------------------

    def discover(
        self,
        family: str,
        *,
        envelope: Envelope | Mapping[str, object],
        sm: str,
        toolchain: Toolchain | Mapping[str, str],
        release: str | None = None,
        binding_signature: str | None = None,
        code: str | None = None,
        limit: int = DEFAULT_DISCOVER_LIMIT,
    ) -> list[Candidate]:
        """The live records matching a declaration, best first (offline or with the store down: the cached answer).

        ``release``, ``binding_signature`` and ``code`` narrow the search when given; at most ``limit``
        candidates (see :func:`cgstore_client.worker.discovery.discover_request`).
        """
        from cgstore_client.worker import discovery

        request = discovery.discover_request(
            family,
            envelope=envelope,
            sm=sm,
            toolchain=toolchain,
            release=release,
            binding_signature=binding_signature,
            code=code,
            limit=limit,
        )
        return discovery.discover(self, request)

    def boot(
        self,
        family: str,
        model: Any,
        *,
        envelope: Envelope | Mapping[str, object],
        toolchain: Toolchain | Mapping[str, str] | None = None,
        sm: str | None = None,
        release: str | None = None,
        code: bool | str = True,
        mandatory: bool = False,
        confirm: str | None = None,
        example_inputs: tuple[Any, ...] | None = None,
        checkpoint: Any = None,
        device: str = "cpu",
        mint: str = "never",
        publish_to: str | None = None,
        dynamic_shapes: Any = None,
        watch: bool = True,
    ) -> Booted:
        """Serve ``model`` compiled from a record discovered by its declaration, confirmed as asked, else eager.

        The declaration: ``family``, ``envelope``, ``sm`` and ``toolchain`` (this environment's when
        None: ``cgstore_client.environment``), ``release``, and ``code`` (True: the fingerprint of the
        model's source; a ``cf1:`` string: that one; False: any code). ``mandatory`` raises
        :class:`CompiledRequired` instead of serving eager. ``confirm``: ``"before"`` (trace and compare
        before serving), ``"background"`` (serve, then confirm off the critical path) or ``"never"``;
        ``example_inputs`` feed the confirmation and the structural gate. ``checkpoint`` binds other
        weights by name (default: the model's own); ``device`` is where the graph runs.
        See :func:`cgstore_client.worker.discovery.boot_by_declaration`.

        The miss path (``cgstore_client.worker.fleet``): ``mint="on_miss"`` claims the declaration in
        ``publish_to`` and, when granted, exports the model on ``example_inputs`` (``dynamic_shapes`` as
        ``torch.export`` takes them) and mints it in a child process while serving eager. ``watch``
        (default on): the handle switches to compiled in place when a record is published for its
        declaration, and to eager when the record it serves is yanked.
        """
        from cgstore_client.worker import fleet

        return fleet.boot(
            self,
            family,
            model,
            mint=mint,
            publish_to=publish_to,
            dynamic_shapes=dynamic_shapes,
            watch=watch,
            mandatory=mandatory,
            example_inputs=example_inputs,
            envelope=envelope,
            toolchain=toolchain,
            sm=sm,
            release=release,
            code=code,
            confirm=confirm,
            checkpoint=checkpoint,
            device=device,
        )

    # --- publish -----------------------------------------------------------------------

    def publish(
        self,
        repo: str,
        archive_path: str | os.PathLike[str],
        *,
        family: str,
        envelope: Envelope | Mapping[str, object],
        toolchain: Toolchain | Mapping[str, str],
        sm: str,
        lane: str | None = None,
        components: Mapping[str, str | os.PathLike[str]] | None = None,
        layout: Mapping[str, Any] | None = None,
        evidence: Mapping[str, Any] | None = None,
        release: str | None = None,
        code: str | None = None,
    ) -> Published:
        """Publish an archive (and its components) under its derived key; safe to call again after any failure.

        The archive is read locally with the store's own reader; only blobs the
        repo lacks are uploaded. ``components=None`` publishes the mint's derived
        constants (``model.constants.safetensors`` beside the archive) when present.
        A key already holding other bytes raises :class:`Conflict` naming both digests.
        ``release`` (a label) and ``code`` (``binding.code_fingerprint(model)``) are what discover can narrow to.
        """
        owner, name = split_repo(repo)
        report = inspect(archive_path)
        envelope = envelope if isinstance(envelope, Envelope) else Envelope.from_dict(envelope)
        toolchain = toolchain if isinstance(toolchain, Toolchain) else Toolchain(toolchain)
        key = ck1(report.graph_digest, envelope, sm, toolchain)
        named = _components(archive_path, components)
        hashed = self.push_blobs(repo, [archive_path, *named.values()])
        lane = lane or (report.metadata.kernel_lane.winner if report.metadata.kernel_lane else DEFAULT_LANE)
        manifest = _manifest(report, family, envelope, toolchain, sm, lane, layout, evidence)
        digest, size = hashed[str(archive_path)]
        manifest["artifact"] = {"digest": digest, "size": size}
        manifest["components"] = [
            {"name": n, "digest": hashed[str(p)][0], "size": hashed[str(p)][1]} for n, p in sorted(named.items())
        ]
        manifest["release"], manifest["code"] = release, code
        body = Manifest.model_validate(manifest).model_dump(mode="json", exclude_none=True)
        answer = parse_answer(
            PublishAnswer,
            self.writer.request("PUT", f"/v1/repos/{owner}/{name}/compiled-graphs/{key}", json=body).content,
        )
        return Published(answer.key, answer.status, answer.receipt)


@dataclass(frozen=True)
class Published:
    """A publish's outcome: the key, ``created`` or ``exists`` (an idempotent re-publish), the store's receipt."""

    key: str
    status: str
    receipt: object = None


def _components(archive_path, components) -> dict[str, str]:
    if components is not None:
        return {name: str(path) for name, path in components.items()}
    from cgstore_client.mint import derived_constants_path  # torch-free: the mint imports torch lazily

    derived = derived_constants_path(archive_path)
    return {DERIVED_COMPONENT: derived} if os.path.exists(derived) else {}


def _manifest(report, family, envelope: Envelope, toolchain: Toolchain, sm, lane, layout, evidence) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "kind": report.kind,
        "format": report.format,
        "family": family,
        "lane": lane,
        "axes": {
            "graph": report.graph_digest,
            "envelope": envelope.document,
            "sm": sm,
            "toolchain": {"components": dict(toolchain.components), "recorded": dict(toolchain.recorded)},
        },
    }
    for field_name, value in (("layout", layout), ("evidence", evidence)):
        if value is not None:
            manifest[field_name] = dict(value)
    return manifest


def _answers(content: bytes) -> list[ResolveHit | Any]:
    """The per-key answers of a resolve body (``wire.records.ResolveAnswer``)."""
    return parse_answer(ResolveAnswer, content).answers


def _record(content: bytes) -> dict[str, Any]:
    """A full record (``wire.records.Record``), as the JSON document the cache keeps."""
    return parse_answer(Record, content).model_dump(mode="json")


def _entry(answer) -> dict[str, Any]:
    """A resolve answer as the cache keeps it: key, repo, the record's facts, blobs (without URLs), receipt.

    The full record (manifest, input contract, binding table) is fetched beside
    the blobs and added as ``record`` before the entry is cached.
    """
    if not isinstance(answer, ResolveHit):
        return {"key": answer.key, "status": "miss"}
    entry = {
        "key": answer.key,
        "status": "hit",
        "repo": answer.repo,
        "facts": answer.record.model_dump(mode="json"),
        "artifact": {"digest": answer.artifact.digest, "size": answer.artifact.size},
        "components": [{"name": c.name, "digest": c.digest, "size": c.size} for c in answer.components],
    }
    receipt = getattr(answer, "receipt", None)  # when the store signs its answers
    if receipt is not None:
        entry["receipt"] = receipt
    return entry
