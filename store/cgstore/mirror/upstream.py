"""The mirror's client of its upstream store: every call bounded in time, the token never shown.

Each call's connect and each wait for its next bytes are bounded by
``CGSTORE_UPSTREAM_TIMEOUT_S``: an upstream that is down, cut off or stalled
makes a call fail with ``UpstreamUnavailable`` within that bound, never hang
(the stalls of zot's sync, zot#4128). The read token is read from
``CGSTORE_UPSTREAM_TOKEN_FILE`` once and lives only in the HTTP client's
headers: no message, ``repr`` or exception built here contains it.

Blobs are fetched in ranged parts, several at once, into a spool file under
``CGSTORE_HOME`` (``fetch_blob``); the parts already written are remembered
beside it, so a pull cut off midway resumes where it stopped. The bytes are
verified by the caller when they enter storage (``storage.writer`` checks the
digest): nothing here is trusted.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import httpx

#: Bytes per ranged GET of a blob pull, and how many run at once.
PART_BYTES = 8 << 20
PARALLEL_PARTS = 4
#: Largest JSON answer read from the upstream (a record, a resolve of one key, a JWKS).
_MAX_JSON_BYTES = 8 << 20


class UpstreamUnavailable(Exception):
    """The upstream did not answer in time, refused the connection, or answered 5xx/429: try later."""


class UpstreamRefused(Exception):
    """The upstream answered that the mirror's token may not do this (401, 403) or the request is bad (4xx)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def read_token(path: Path | None) -> str | None:
    """The upstream token of ``CGSTORE_UPSTREAM_TOKEN_FILE`` (surrounding whitespace dropped); None without one."""
    if path is None:
        return None
    return Path(path).read_text().strip() or None


class Upstream:
    """A bounded-timeout client of the upstream's API (``GET``/``POST`` JSON, ranged blob reads, the events feed)."""

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        headers = {"User-Agent": "cgstore-mirror"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=16)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout_s), limits=limits)

    def __repr__(self) -> str:  # never the headers: they hold the token
        return f"Upstream({self.url!r})"

    def close(self) -> None:
        self._http.close()

    # -- JSON calls ---------------------------------------------------------------------

    def resolve(self, family: str, keys: list[str]) -> dict[str, Any]:
        return self._json("POST", "/v1/compiled-graphs:resolve", json={"family": family, "keys": keys})

    def discover(self, declaration: dict[str, Any]) -> dict[str, Any]:
        return self._json("POST", "/v1/compiled-graphs:discover", json=declaration)

    def record(self, owner: str, repo: str, key: str) -> dict[str, Any] | None:
        """The record, or None when the upstream answers 404 (absent, or not readable by the mirror's token)."""
        return self._json("GET", f"/v1/repos/{owner}/{repo}/compiled-graphs/{key}", missing_ok=True)

    def jwks(self) -> dict[str, Any]:
        return self._json("GET", "/v1/keys")

    def key_statements(self) -> list[str]:
        """The upstream's key-set statements (``GET /v1/keys:statements``), one JWS per key it signs with."""
        answer = self._json("GET", "/v1/keys:statements", missing_ok=True) or {}
        statements = answer.get("statements")
        return [s for s in statements if isinstance(s, str)] if isinstance(statements, list) else []

    def blob_size(self, owner: str, repo: str, digest: str) -> int | None:
        """The size of a blob the mirror's token reads in ``owner/repo`` (``HEAD``), or None if the upstream has none."""
        path = f"/v1/repos/{owner}/{repo}/blobs/{digest}"
        try:
            response = self._http.head(path)
        except httpx.HTTPError as err:
            raise UpstreamUnavailable(f"HEAD blob: {type(err).__name__}") from None
        if response.status_code == 404:
            return None
        _check_status("HEAD", "blob", response)
        try:
            return int(response.headers["content-length"])
        except (KeyError, ValueError):
            raise UpstreamRefused("HEAD blob: no size", 502) from None

    def events(self, since: str | None, wait: int, family: str | None = None) -> dict[str, Any]:
        """One long-poll of the upstream's events feed (``GET /v1/compiled-graphs:events``)."""
        params: dict[str, Any] = {"wait": wait}
        if since is not None:
            params["since"] = since
        if family is not None:
            params["family"] = family
        timeout = httpx.Timeout(self.timeout_s, read=wait + self.timeout_s)
        return self._json("GET", "/v1/compiled-graphs:events", params=params, timeout=timeout)

    def ping(self) -> None:
        """Raise ``UpstreamUnavailable`` unless the upstream answers ``/healthz`` within a second (or the
        timeout, if shorter): ``/healthz`` of the mirror asks this, and a liveness probe must not wait long."""
        self._json("GET", "/healthz", timeout=httpx.Timeout(min(1.0, self.timeout_s)))

    def _json(
        self,
        method: str,
        path: str,
        *,
        missing_ok: bool = False,
        timeout: httpx.Timeout | None = None,
        **kwargs,
    ) -> Any:
        try:
            response = self._http.request(method, path, timeout=timeout or self._http.timeout, **kwargs)
        except httpx.HTTPError as err:
            raise UpstreamUnavailable(f"{method} {path}: {type(err).__name__}") from None
        if missing_ok and response.status_code == 404:
            return None
        _check_status(method, path, response)
        if len(response.content) > _MAX_JSON_BYTES:
            raise UpstreamRefused(f"{method} {path}: answer over {_MAX_JSON_BYTES} bytes", 502)
        try:
            return response.json()
        except ValueError:
            raise UpstreamRefused(f"{method} {path}: not JSON", 502) from None

    # -- blobs --------------------------------------------------------------------------

    def fetch_blob(self, owner: str, repo: str, digest: str, size: int, spool: Path) -> Path:
        """The blob's ``size`` bytes in ``spool`` (a file), fetched in parallel ranged parts; resumable.

        Parts already fetched by an interrupted pull (listed in ``spool`` + ``.parts``)
        are not fetched again. The first part asked of the upstream tells where
        the bytes are: its own answer, or a presigned URL of its bucket (307) that
        the other parts then read directly. The bytes are not verified here.
        """
        done_path = spool.with_name(spool.name + ".parts")
        done = _parts_done(done_path)
        with open(spool, "ab") as handle:  # created if absent; never truncated below what it holds (resume)
            if os.fstat(handle.fileno()).st_size != size:
                handle.truncate(size)
        parts = [(start, min(start + PART_BYTES, size)) for start in range(0, size, PART_BYTES)]
        todo = [part for part in parts if part[0] not in done]
        url = self.url + f"/v1/repos/{owner}/{repo}/blobs/{digest}"
        with open(spool, "r+b") as handle, open(done_path, "a") as log:
            fd = handle.fileno()
            if todo:
                url, first_done = self._first_part(url, todo[0], fd)
                if first_done:
                    log.write(f"{todo[0][0]}\n")
                    log.flush()
                    todo = todo[1:]
            if todo:
                with concurrent.futures.ThreadPoolExecutor(min(PARALLEL_PARTS, len(todo))) as pool:
                    for start in pool.map(lambda part: self._fetch_part(url, part, fd), todo):
                        log.write(f"{start}\n")
                        log.flush()
        with contextlib.suppress(FileNotFoundError):
            done_path.unlink()
        return spool

    def _first_part(self, url: str, part: tuple[int, int], fd: int) -> tuple[str, bool]:
        """Ask the upstream for ``part``: (where to read the rest, whether ``part`` is written)."""
        request = self._http.build_request("GET", url, headers={"Range": f"bytes={part[0]}-{part[1] - 1}"})
        try:
            response = self._http.send(request, stream=True, follow_redirects=False)
        except httpx.HTTPError as err:
            raise UpstreamUnavailable(f"GET blob: {type(err).__name__}") from None
        with contextlib.closing(response):
            if response.status_code in (301, 302, 303, 307, 308) and "location" in response.headers:
                return str(response.url.join(response.headers["location"])), False
            _check_status("GET", "blob", response)
            self._write_part(response, part, fd)
        return url, True

    def _fetch_part(self, url: str, part: tuple[int, int], fd: int) -> int:
        headers = {"Range": f"bytes={part[0]}-{part[1] - 1}"}
        # The token goes only to the upstream itself, never to the bucket a presigned URL names.
        own = url.startswith(self.url + "/")
        try:
            with (
                self._http.stream("GET", url, headers=headers)
                if own
                else httpx.stream("GET", url, headers=headers, timeout=self.timeout_s)
            ) as response:
                _check_status("GET", "blob part", response)
                self._write_part(response, part, fd)
        except httpx.HTTPError as err:
            raise UpstreamUnavailable(f"GET blob part: {type(err).__name__}") from None
        return part[0]

    @staticmethod
    def _write_part(response: httpx.Response, part: tuple[int, int], fd: int) -> None:
        start, end = part
        offset = start
        try:
            for chunk in response.iter_bytes(1 << 20):
                if offset + len(chunk) > end:
                    raise UpstreamRefused("blob part: more bytes than asked", 502)
                os.pwrite(fd, chunk, offset)
                offset += len(chunk)
        except httpx.HTTPError as err:
            raise UpstreamUnavailable(f"GET blob part: {type(err).__name__}") from None
        if offset != end:
            raise UpstreamUnavailable(f"blob part {start}-{end}: {offset - start} of {end - start} bytes")


def _check_status(method: str, path: str, response: httpx.Response) -> None:
    status = response.status_code
    if status < 300 or status in (301, 302, 303, 307, 308):
        return
    if status >= 500 or status == 429:
        raise UpstreamUnavailable(f"{method} {path}: {status}")
    raise UpstreamRefused(f"{method} {path}: {status} {_error_code(response)}", status)


def _error_code(response: httpx.Response) -> str:
    with contextlib.suppress(Exception):
        response.read()
        return str(json.loads(response.content)["error"]["code"])[:40]
    return ""


def _parts_done(path: Path) -> set[int]:
    try:
        return {int(line) for line in path.read_text().split()}
    except (FileNotFoundError, ValueError):
        return set()
