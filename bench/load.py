"""A bounded mixed workload through two store replicas: errors, throughput, p99 and server RSS.

    python bench/load.py                                   # 32 clients, 2 minutes
    python bench/load.py --clients 8 --duration-s 20       # a quick check

Starts its own PostgreSQL database, Ceph's RADOS Gateway (S3) and two ``cgstore serve``
processes (PostgreSQL + S3, presigned download URLs on) that share the
database, the bucket and ``CGSTORE_HOME`` (so the signing key), and stops them
afterwards. No load balancer: every client alternates between the two replicas
request by request, so each multi-request operation crosses replicas.

Seed: the cached real ``.pt2`` archive A (``tests/support/archives.py``) and
its constants component are uploaded once, then ``--records`` compiled-graph
records are published through the API (full admission: the archive is read
statically on every publish), each under its own ck1 key (the envelope's
``text_len`` differs, so the key does).

Then ``--clients`` threads run operations back to back for ``--duration-s``,
drawn at random (weights in ``MIX``):

- ``resolve``: ``POST /v1/compiled-graphs:resolve`` with 256 keys, 128 drawn
  from the published ones and 128 absent; the answer must hit exactly those.
- ``fetch``: ``GET …/blobs/{digest}`` of the artifact, the component or a blob
  uploaded during the run; it must answer 307, and the presigned URL (fetched
  without the cap-token) must yield bytes of exactly that blake3 digest.
- ``publish``: re-publishing a seeded record must answer 200 ``exists``; one
  in ``CONFLICT_EVERY`` publishes deliberately offers another component set
  under a live key and must answer 409 ``KEY_CONFLICT``.
- ``upload``: a fresh random 1–64 KiB blob, monolithic (``PUT``, 201) or, every
  other time, chunked (``POST`` 202, 2–4 ``PATCH`` 202, ``PUT ?digest=`` 201), the
  session begun on one replica and continued and committed on the other.

An error is any other answer (or a transport failure); the first few are
printed. Both replicas' RSS is read before the workload, every
``--rss-every-s`` during it, and after it.

Last line: ``{"errors", "ops_per_s", "p99_ms": {"resolve", "fetch", "publish",
"upload"}, "rss_start_mib", "rss_end_mib"}``; RSS figures are per replica.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import blake3
import httpx
import psutil
from _common import MiB, emit_result, log, replicated_stack, timed

from tests.compiled_graphs.support import (
    CONSTANTS_A,
    FAMILY,
    Blob,
    Publication,
    digest_of,
    publication,
    safetensors_bytes,
)
from tests.support.archives import archive_report, ensure_archives

OWNER, REPO = "acme", "load"
BASE = f"/v1/repos/{OWNER}/{REPO}"
KEYS_PER_RESOLVE = 256
HITS_PER_RESOLVE = 128
#: Relative frequency of each operation.
MIX = {"resolve": 25, "fetch": 35, "publish": 10, "upload": 30}
#: One publish in this many is a deliberate conflict (409 KEY_CONFLICT expected).
CONFLICT_EVERY = 10
UPLOAD_MIN, UPLOAD_MAX = 1 << 10, 64 << 10
#: Uploaded blobs kept as fetch candidates (the newest ones).
FETCH_POOL = 512
ERRORS_SHOWN = 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=120.0, help="workload duration (default 120)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--records", type=int, default=32, help="records published before the workload (default 32)")
    parser.add_argument("--rss-every-s", type=float, default=15.0, help="RSS detail line interval (default 15)")
    return parser.parse_args()


# -- what the workload works on --------------------------------------------------------------


@dataclass
class Corpus:
    """The seeded records, their conflicting variants and the blobs clients fetch."""

    records: list[Publication]
    conflicts: list[Publication]
    artifact: Blob
    component: Blob
    uploaded: collections.deque = field(default_factory=lambda: collections.deque(maxlen=FETCH_POOL))

    def fetch_candidate(self, rng: random.Random) -> tuple[str, int]:
        choice = rng.randrange(3)
        if choice == 0 or not self.uploaded:
            return self.artifact.digest, self.artifact.size
        if choice == 1:
            return self.component.digest, self.component.size
        return rng.choice(self.uploaded)


def build_corpus(records: int) -> Corpus:
    archive = ensure_archives().base
    report = archive_report(archive)
    constants = safetensors_bytes(CONSTANTS_A)

    def envelope(n: int) -> dict:
        return {"shapes": [[1024, 1024]], "text_len": 1 + n, "guidance": [3.5]}

    published = [
        publication(archive, report, components={"consts": constants}, envelope=envelope(n)) for n in range(records)
    ]
    # Same key, same artifact, another component set: a write-once conflict.
    conflicts = [
        publication(archive, report, components={"consts-v2": constants}, envelope=envelope(n)) for n in range(records)
    ]
    assert all(c.key == p.key for c, p in zip(conflicts, published, strict=True))
    assert len({p.key for p in published}) == records
    return Corpus(published, conflicts, published[0].artifact, published[0].components["consts"])


def seed(clients: list[httpx.Client], corpus: Corpus) -> None:
    """Upload the artifact and component once, then publish every record (spread over the replicas)."""
    for blob in (corpus.artifact, corpus.component):
        response = clients[0].put(f"{BASE}/blobs/{blob.digest}", content=blob.data)
        if response.status_code != 201:
            raise RuntimeError(f"seed upload answered {response.status_code}: {response.text[:300]}")

    def publish(indexed: tuple[int, Publication]) -> None:
        n, pub = indexed
        response = clients[n % len(clients)].put(pub.path(OWNER, REPO), json=pub.manifest)
        if response.status_code != 201:
            raise RuntimeError(f"seed publish answered {response.status_code}: {response.text[:300]}")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(publish, enumerate(corpus.records)))


# -- the operations: each returns None when answered as intended, else what went wrong ----------


class Client:
    """One workload client: a keep-alive connection per replica, used alternately."""

    def __init__(self, base_urls: list[str], token: str, corpus: Corpus, seed: int) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        self._replicas = [httpx.Client(base_url=url, headers=headers, timeout=60) for url in base_urls]
        self._turn = itertools.cycle(range(len(base_urls)))
        self._storage = httpx.Client(timeout=60)  # presigned URLs: no cap-token
        self.corpus = corpus
        self.rng = random.Random(seed)
        self._publishes = 0
        self._uploads = 0
        self.upload_kind = ""  # of the last upload: monolithic or chunked
        self.intended_conflicts = 0  # 409 KEY_CONFLICT answers to the deliberate conflicts

    def next_replica(self) -> httpx.Client:
        return self._replicas[next(self._turn)]

    def close(self) -> None:
        for client in (*self._replicas, self._storage):
            client.close()

    def resolve(self) -> str | None:
        hits = [p.key for p in self.rng.choices(self.corpus.records, k=HITS_PER_RESOLVE)]
        misses = ["ck1-" + self.rng.randbytes(28).hex() for _ in range(KEYS_PER_RESOLVE - HITS_PER_RESOLVE)]
        keys = hits + misses
        self.rng.shuffle(keys)
        response = self.next_replica().post("/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": keys})
        if response.status_code != 200:
            return _unexpected(response)
        answers = response.json()["answers"]
        expected = {key: "hit" for key in hits} | {key: "miss" for key in misses}
        got = [(a["key"], a["status"]) for a in answers]
        if got != [(key, expected[key]) for key in keys]:
            return "resolve: answers differ from the keys asked (order or hit/miss)"
        return None

    def fetch(self) -> str | None:
        digest, size = self.corpus.fetch_candidate(self.rng)
        redirect = self.next_replica().get(f"{BASE}/blobs/{digest}")
        if redirect.status_code != 307:
            return _unexpected(redirect)
        hasher, received = blake3.blake3(), 0
        with self._storage.stream("GET", redirect.headers["Location"]) as response:
            if response.status_code != 200:
                return f"presigned GET answered {response.status_code}"
            for chunk in response.iter_bytes(MiB):
                hasher.update(chunk)
                received += len(chunk)
        if "blake3:" + hasher.hexdigest() != digest or received != size:
            return f"fetched bytes do not match {digest} ({received} of {size} bytes)"
        return None

    def publish(self) -> str | None:
        self._publishes += 1
        conflict = self._publishes % CONFLICT_EVERY == 0
        pool = self.corpus.conflicts if conflict else self.corpus.records
        pub = self.rng.choice(pool)
        response = self.next_replica().put(pub.path(OWNER, REPO), json=pub.manifest)
        if conflict:
            if response.status_code == 409 and response.json()["error"]["code"] == "KEY_CONFLICT":
                self.intended_conflicts += 1
                return None
            return _unexpected(response)
        if response.status_code == 200 and response.json()["status"] == "exists":
            return None
        return _unexpected(response)

    def upload(self) -> str | None:
        self._uploads += 1
        data = os.urandom(self.rng.randint(UPLOAD_MIN, UPLOAD_MAX))
        digest = digest_of(data)
        self.upload_kind = "chunked" if self._uploads % 2 == 0 else "monolithic"
        error = self._chunked(data, digest) if self.upload_kind == "chunked" else self._monolithic(data, digest)
        if error is None:
            self.corpus.uploaded.append((digest, len(data)))
        return error

    def _monolithic(self, data: bytes, digest: str) -> str | None:
        response = self.next_replica().put(f"{BASE}/blobs/{digest}", content=data)
        return None if response.status_code == 201 else _unexpected(response)

    def _chunked(self, data: bytes, digest: str) -> str | None:
        opened = self.next_replica().post(f"{BASE}/uploads")
        if opened.status_code != 202:
            return _unexpected(opened)
        location = opened.headers["Location"]
        cuts = sorted(self.rng.sample(range(1, len(data)), self.rng.randint(1, 3)))
        for start, end in itertools.pairwise([0, *cuts, len(data)]):
            chunk = self.next_replica().patch(
                location, content=data[start:end], headers={"Content-Range": f"{start}-{end - 1}"}
            )
            if chunk.status_code != 202:
                return _unexpected(chunk)
        committed = self.next_replica().put(location, params={"digest": digest})
        return None if committed.status_code == 201 else _unexpected(committed)


def _unexpected(response: httpx.Response) -> str:
    request = response.request
    return f"{request.method} {request.url.path} answered {response.status_code}: {response.text[:200]}"


# -- running it ----------------------------------------------------------------------------


@dataclass
class Tally:
    """Latencies and errors per operation, shared by the client threads."""

    latencies_ms: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in MIX})
    #: Latencies of the two kinds of upload, for the detail lines.
    upload_ms: dict[str, list[float]] = field(default_factory=lambda: {"monolithic": [], "chunked": []})
    errors: collections.Counter = field(default_factory=collections.Counter)
    first_errors: list[str] = field(default_factory=list)
    intended_conflicts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, op: str, elapsed_ms: float, error: str | None, upload_kind: str) -> None:
        with self.lock:
            self.latencies_ms[op].append(elapsed_ms)
            if op == "upload":
                self.upload_ms[upload_kind].append(elapsed_ms)
            if error is not None:
                self.errors[op] += 1
                if len(self.first_errors) < ERRORS_SHOWN:
                    self.first_errors.append(f"{op}: {error}")


def run_client(client: Client, tally: Tally, start: threading.Barrier, stop: threading.Event) -> None:
    operations: dict[str, Callable[[], str | None]] = {op: getattr(client, op) for op in MIX}
    names, weights = list(MIX), list(MIX.values())
    start.wait()
    try:
        while not stop.is_set():
            op = client.rng.choices(names, weights)[0]
            began = time.perf_counter()
            try:
                error = operations[op]()
            except (httpx.HTTPError, ValueError, KeyError) as exc:  # transport failure or a malformed answer
                error = f"{type(exc).__name__}: {exc}"
            tally.record(op, (time.perf_counter() - began) * 1000, error, client.upload_kind)
    finally:
        client.close()


def rss_of(pids: list[int]) -> list[float]:
    return [round(psutil.Process(pid).memory_info().rss / MiB, 1) for pid in pids]


def watch_rss(pids: list[int], every_s: float, stop: threading.Event, began: float) -> None:
    while not stop.wait(every_s):
        log(f"  t={time.monotonic() - began:5.0f} s  replica RSS (MiB): {rss_of(pids)}")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))] if ordered else 0.0


def workload(stack, token: str, corpus: Corpus, args) -> tuple[Tally, float]:
    """Run the clients for ``args.duration_s`` (operations in flight then finish); the wall time."""
    tally, stop = Tally(), threading.Event()
    start = threading.Barrier(args.clients + 1)
    clients = [Client(stack.base_urls, token, corpus, seed=n) for n in range(args.clients)]
    threads = [threading.Thread(target=run_client, args=(client, tally, start, stop)) for client in clients]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.monotonic()
    watcher = threading.Thread(target=watch_rss, args=(stack.server_pids, args.rss_every_s, stop, began), daemon=True)
    watcher.start()
    stop.wait(args.duration_s)
    stop.set()
    for thread in threads:
        thread.join()
    tally.intended_conflicts = sum(client.intended_conflicts for client in clients)
    return tally, time.monotonic() - began


def report(tally: Tally, wall: float) -> None:
    rows = {**tally.latencies_ms, **{f"  {kind}": values for kind, values in tally.upload_ms.items()}}
    for op, values in rows.items():
        errors = f"  errors {tally.errors[op]}" if op in MIX else ""
        log(
            f"{op:>12}: {len(values):6d} ops ({len(values) / wall:6.1f}/s)  p50 {percentile(values, 0.5):7.1f} ms  "
            f"p99 {percentile(values, 0.99):7.1f} ms  max {max(values, default=0):7.1f} ms{errors}"
        )
    log(f"intended 409 KEY_CONFLICT answers (counted as publishes, not errors): {tally.intended_conflicts}")
    for line in tally.first_errors:
        log("  error:", line)


def main() -> None:
    args = parse_args()
    corpus = build_corpus(args.records)
    with replicated_stack("cgstore_bench_load", replicas=2, redirect_downloads=True, reaper_interval_s=3600) as stack:
        token = stack.mint("load-client", f"{OWNER}/{REPO}:read,write")
        seeders = [
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120)
            for url in stack.base_urls
        ]
        began = time.perf_counter()
        seed(seeders, corpus)
        for client in seeders:
            client.close()
        log(
            f"seeded {args.records} records through {len(stack.base_urls)} replicas "
            f"in {time.perf_counter() - began:.1f} s; load average {os.getloadavg()}"
        )
        rss_start = rss_of(stack.server_pids)
        log(f"replica RSS at start (MiB): {rss_start}; {args.clients} clients for {args.duration_s:.0f} s")
        watch = {f"replica {n + 1}": pid for n, pid in enumerate(stack.server_pids)}
        watch |= {**stack.stacks[0].s3_pids, "clients (this process)": os.getpid()}
        with timed(watch) as timing:
            tally, wall = workload(stack, token, corpus, args)
        rss_end = rss_of(stack.server_pids)
        log(
            "CPU during the workload: "
            + ", ".join(f"{name} {seconds / timing.wall_s:.0%}" for name, seconds in timing.cpu_s.items())
            + " of one core"
        )
        log(f"replica RSS at end (MiB): {rss_end}; load average {os.getloadavg()}")
    report(tally, wall)
    total = sum(len(values) for values in tally.latencies_ms.values())
    emit_result(
        {
            "errors": sum(tally.errors.values()),
            "ops_per_s": round(total / wall, 1),
            "p99_ms": {op: round(percentile(tally.latencies_ms[op], 0.99), 1) for op in MIX},
            "rss_start_mib": rss_start,
            "rss_end_mib": rss_end,
        }
    )


if __name__ == "__main__":
    main()
