"""Batch resolve latency with 1 k and with 100 k records: does it stay flat as the table grows?

    python bench/resolve.py                      # 16 clients, 1 k then 100 k records
    python bench/resolve.py --clients 4 --requests 40
    python bench/resolve.py --workers 1          # one store process (default 2: CGSTORE_WORKERS)

Starts its own PostgreSQL database, Ceph's RADOS Gateway (S3) and the store (PostgreSQL + S3,
presigned download URLs on, ``--workers`` processes) as a separate process, and
stops them afterwards.
Records are seeded in bulk with SQL straight into the store's database (a
publish per record would take hours of archive reading and measure nothing
about resolve): 1 k records first, measured, then 99 k more, measured again,
through the same running store.

Every request is the one a booting worker sends: ``POST
/v1/compiled-graphs:resolve`` with 256 keys, half of them published (drawn
at random from the whole table) and half absent, answered with 128 hits, each
with a presigned artifact URL and a presigned component URL. ``--clients``
threads send requests back to back, each over its own keep-alive connection;
the latency of each request is measured from the first byte sent to the last
byte received.

Then, at each size, the request a worker booting by declaration sends: ``POST
/v1/compiled-graphs:discover`` with a family, envelope, sm and toolchain
(keyed and recorded versions). Every record carries the ``discovery_digest``
publish would have stored (``cgstore_client.binding.discovery_digest`` of its
real canonical envelope and toolchain); the envelope's ``text_len`` differs
every ``MATCHES_PER_DECLARATION`` records, so each declaration (drawn at
random from the whole table) matches exactly that many records and the answer
holds that many candidates, each with presigned URLs (checked on a sampled
answer before measuring). Sent by the same ``--clients`` threads, and at the
large size once more by one client alone.

Last line: ``{"p50_ms_1k", "p99_ms_1k", "p50_ms_100k", "p99_ms_100k", "p99_ratio",
"discover_p50_ms_1k", "discover_p99_ms_1k", "discover_p50_ms_100k", "discover_p99_ms_100k",
"discover_p99_ratio", "discover_one_client_p99_ms_100k"}`` (ratios = 100 k ÷ 1 k; "100k" is
``--large``, "1k" is ``--small``), plus the client count, request count and store processes it was taken with.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import random
import threading
import time

import httpx
from _common import emit_result, log, production_stack
from sqlalchemy import create_engine, text

from cgstore_client.binding import discovery_digest
from cgstore_client.keys import Envelope, Toolchain

FAMILY = "bench-family"
KEYS_PER_REQUEST = 256
HITS_PER_REQUEST = 128
SEED_BATCH = 5000
RESOLVE = "/v1/compiled-graphs:resolve"
DISCOVER = "/v1/compiled-graphs:discover"
SM = "sm_90"
#: Records sharing one declaration: what one discover matches (the default discover limit answers them all).
MATCHES_PER_DECLARATION = 4
#: The declared toolchain: keyed torch, recorded diffusers (folded into the discovery digest, not the key).
TOOLCHAIN = {"components": {"torch": "2.13.0"}, "recorded": {"diffusers": "0.36.0"}}
_TOOLCHAIN = Toolchain({**TOOLCHAIN["components"], **TOOLCHAIN["recorded"]})


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument("--requests", type=int, default=40, help="measured requests per client per size (default 40)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured requests per client first (default 3)")
    parser.add_argument("--small", type=int, default=1_000, help="records in the first measurement (default 1000)")
    parser.add_argument(
        "--workers", type=int, default=2, help="store processes, CGSTORE_WORKERS (default 2: one per core)"
    )
    parser.add_argument("--large", type=int, default=100_000, help="records in the second (default 100000)")
    return parser.parse_args()


def fake_digest(kind: str, n: int) -> str:
    return "blake3:" + f"{kind}{n:x}".encode().hex().ljust(64, "0")[:64]


def fake_key(n: int) -> str:
    return "ck1-" + f"{n:056x}"


def declared_envelope(group: int) -> dict:
    """Declaration ``group``'s envelope: records ``group * MATCHES_PER_DECLARATION`` onwards carry it."""
    return {"v": 1, "shapes": [[1024, 1024]], "text_len": 1 + group, "guidance": ["3.5"], "batch_sizes": [1]}


@functools.lru_cache(maxsize=1)
def _declaration_columns(group: int) -> dict:
    """The envelope, toolchain and discovery columns publish would store for declaration ``group``."""
    envelope = Envelope.from_dict(declared_envelope(group))
    return {
        "envelope": json.dumps(envelope.document),
        "envelope_digest": envelope.digest,
        "toolchain": json.dumps(_TOOLCHAIN.document),
        "toolchain_digest": _TOOLCHAIN.digest,
        "recorded_versions": json.dumps(dict(_TOOLCHAIN.recorded)),
        "discovery_digest": discovery_digest(FAMILY, envelope.digest, SM, _TOOLCHAIN.digest, _TOOLCHAIN.recorded),
    }


def seed(database_url: str, start: int, stop: int) -> None:
    """Records ``start..stop-1`` in ``root/bench-family``, each with its own artifact and one shared component."""
    engine = create_engine(database_url)
    now = dt.datetime.now(dt.UTC)
    component = fake_digest("c", 0)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO repos (owner, name, visibility, created_by, created_at) "
                "VALUES ('root', 'bench-family', 'owner', 'bench', :now) ON CONFLICT DO NOTHING"
            ),
            {"now": now},
        )
        repo_id = conn.execute(text("SELECT id FROM repos WHERE owner='root' AND name='bench-family'")).scalar()
        conn.execute(
            text(
                "INSERT INTO blobs (digest, size, created_at, linked_at) VALUES (:d, 28, :now, :now) ON CONFLICT DO NOTHING"
            ),
            {"d": component, "now": now},
        )
    for low in range(start, stop, SEED_BATCH):
        high = min(low + SEED_BATCH, stop)
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO blobs (digest, size, created_at, linked_at) VALUES (:d, 1565188, :now, :now)"),
                [{"d": fake_digest("a", n), "now": now} for n in range(low, high)],
            )
            conn.execute(text(_INSERT_RECORD), [_record(repo_id, n, now) for n in range(low, high)])
            conn.execute(
                text(
                    "INSERT INTO compiled_graph_components (record_id, name, digest, size) "
                    "SELECT id, 'consts', :c, 28 FROM compiled_graphs WHERE repo_id = :r AND id > :after"
                ),
                {"c": component, "r": repo_id, "after": _max_component_record(conn)},
            )
    with engine.connect() as conn:
        # VACUUM and CHECKPOINT now, so autovacuum and the checkpointer do not
        # catch up on the seeding's writes while the next measurement runs.
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text("VACUUM ANALYZE"))
        conn.execute(text("CHECKPOINT"))
    engine.dispose()


def _max_component_record(conn) -> int:
    return conn.execute(text("SELECT COALESCE(MAX(record_id), 0) FROM compiled_graph_components")).scalar()


_COLUMNS = (
    "repo_id, key, kind, format, family, lane, sm, graph_digest, envelope, envelope_digest, toolchain, "
    "toolchain_digest, recorded_versions, artifact_digest, artifact_size, component_set, layout_display, "
    "layout_topology, layout_quant, input_contract, binding_table, kernel_lane, publisher, publisher_jti, "
    "created_at, health, discovery_digest"
)
_INSERT_RECORD = (
    f"INSERT INTO compiled_graphs ({_COLUMNS}) VALUES ({', '.join(':' + c.strip() for c in _COLUMNS.split(','))})"
)
_KERNEL_LANE = json.dumps(
    {
        "winner": "baseline+packed",
        "rule": "fit-constrained-speed/1",
        "binding": "speed",
        "margin_fraction": 0.05,
        "candidates": ["baseline+dense", "baseline+packed"],
        "fit": None,
    }
)


def _record(repo_id: int, n: int, now: dt.datetime) -> dict:
    return {
        "repo_id": repo_id,
        "key": fake_key(n),
        "kind": "aot-inductor",
        "format": "pt2",
        "family": FAMILY,
        "lane": "baseline+packed",
        "sm": SM,
        "graph_digest": fake_digest("g", n),
        **_declaration_columns(n // MATCHES_PER_DECLARATION),
        "artifact_digest": fake_digest("a", n),
        "artifact_size": 1565188,
        "component_set": fake_digest("s", 0),
        "layout_display": "flux2.diffusers@1+cozy.fp8-rowwise@1",
        "layout_topology": fake_digest("l", 0),
        "layout_quant": fake_digest("q", 0),
        "input_contract": json.dumps({"v": 1, "inputs": [], "dims": {}}),
        "binding_table": "[]",
        "kernel_lane": _KERNEL_LANE,
        "publisher": "bench",
        "publisher_jti": None,
        "created_at": now,
        "health": "ok",
    }


def request_bodies(records: int, count: int, rng: random.Random) -> list[bytes]:
    """``count`` resolve bodies: 128 published keys drawn from the whole table and 128 absent ones, shuffled."""
    bodies = []
    for _ in range(count):
        keys = [fake_key(n) for n in rng.sample(range(records), HITS_PER_REQUEST)]
        keys += [fake_key(10**9 + rng.randrange(10**9)) for _ in range(KEYS_PER_REQUEST - HITS_PER_REQUEST)]
        rng.shuffle(keys)
        bodies.append(json.dumps({"family": FAMILY, "keys": keys}).encode())
    return bodies


def discover_bodies(records: int, count: int, rng: random.Random) -> list[bytes]:
    """``count`` discover bodies, each declaring one of the table's declarations drawn at random."""
    groups = rng.sample(range(records // MATCHES_PER_DECLARATION), count)
    return [
        json.dumps({"family": FAMILY, "envelope": declared_envelope(group), "sm": SM, "toolchain": TOOLCHAIN}).encode()
        for group in groups
    ]


def post(base_url: str, token: str, path: str, body: bytes) -> dict:
    return httpx.post(
        f"{base_url}{path}",
        content=body,
        timeout=120,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    ).json()


def check_resolve(base_url: str, token: str, body: bytes) -> None:
    answer = post(base_url, token, RESOLVE, body)
    hits = [a for a in answer["answers"] if a["status"] == "hit"]
    assert len(hits) == HITS_PER_REQUEST, f"{len(hits)} hits"
    assert_presigned(hits[0])


def check_discover(base_url: str, token: str, body: bytes) -> None:
    """The figure is of answers with candidates: a sampled declaration matches its records, not none."""
    candidates = post(base_url, token, DISCOVER, body)["candidates"]
    assert len(candidates) == MATCHES_PER_DECLARATION, f"{len(candidates)} candidates"
    assert_presigned(candidates[0])


def assert_presigned(hit: dict) -> None:
    assert hit["artifact"]["url"].startswith("http") and "X-Amz-Signature" in hit["artifact"]["url"]


def measure(
    base_url: str, token: str, path: str, bodies: list[bytes], clients: int, requests: int, warmup: int
) -> list[float]:
    """Latencies (ms) of ``clients`` x ``requests`` posts to ``path`` sent back to back by ``clients`` threads."""
    latencies: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def client(index: int) -> None:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        with httpx.Client(base_url=base_url, headers=headers, timeout=120) as http:
            mine = []
            for i in range(warmup + requests):
                if i == warmup:
                    barrier.wait()
                body = bodies[(index * 7919 + i) % len(bodies)]
                started = time.perf_counter()
                response = http.post(path, content=body)
                response.read()
                elapsed = (time.perf_counter() - started) * 1000
                if response.status_code != 200:
                    raise RuntimeError(f"{path} answered {response.status_code}: {response.text[:200]}")
                if i >= warmup:
                    mine.append(elapsed)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def run(
    stack, token: str, records: int, path: str, bodies: list[bytes], clients: int, requests: int, warmup: int
) -> tuple[float, float]:
    """(p50, p99) in ms of ``path`` at ``records`` records, logged with throughput."""
    started = time.perf_counter()
    latencies = measure(stack.base_url, token, path, bodies, clients, requests, warmup)
    wall = time.perf_counter() - started
    p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
    log(
        f"{records:>7} records: {len(latencies)} {path.rsplit(':', 1)[1]} by {clients} clients in {wall:.1f} s "
        f"({len(latencies) / wall:.0f}/s): p50 {p50:.1f} ms, p90 {percentile(latencies, 0.9):.1f} ms, "
        f"p99 {p99:.1f} ms, max {max(latencies):.1f} ms"
    )
    return p50, p99


def run_size(stack, token: str, records: int, args, rng: random.Random) -> dict[str, tuple[float, float]]:
    """Resolve then discover at ``records`` records, by ``--clients`` clients: {path: (p50, p99)}."""
    figures = {}
    for path, bodies, check in (
        (RESOLVE, request_bodies(records, 64, rng), check_resolve),
        (DISCOVER, discover_bodies(records, 64, rng), check_discover),
    ):
        check(stack.base_url, token, bodies[0])
        figures[path] = run(stack, token, records, path, bodies, args.clients, args.requests, args.warmup)
    return figures


def main() -> None:
    args = parse_args()
    rng = random.Random(20261203)
    with production_stack(
        "cgstore_bench_resolve", redirect_downloads=True, reaper_interval_s=3600, workers=args.workers
    ) as stack:
        token = stack.mint("bench-worker", "bench/*:read")
        started = time.perf_counter()
        seed(stack.database_url, 0, args.small)
        log(f"seeded {args.small} records in {time.perf_counter() - started:.1f} s")
        small = run_size(stack, token, args.small, args, rng)
        started = time.perf_counter()
        seed(stack.database_url, args.small, args.large)
        log(f"seeded {args.large - args.small} more records in {time.perf_counter() - started:.1f} s")
        large = run_size(stack, token, args.large, args, rng)
        # One client alone, as many requests as all clients sent: its p99 is then a percentile, not the max.
        _, one_client_p99 = run(
            stack,
            token,
            args.large,
            DISCOVER,
            discover_bodies(args.large, 64, rng),
            1,
            args.clients * args.requests,
            args.warmup,
        )
    result = {}
    for prefix, path in (("", RESOLVE), ("discover_", DISCOVER)):
        (p50_small, p99_small), (p50_large, p99_large) = small[path], large[path]
        result.update(
            {
                f"{prefix}p50_ms_1k": round(p50_small, 2),
                f"{prefix}p99_ms_1k": round(p99_small, 2),
                f"{prefix}p50_ms_100k": round(p50_large, 2),
                f"{prefix}p99_ms_100k": round(p99_large, 2),
                f"{prefix}p99_ratio": round(p99_large / p99_small, 3),
            }
        )
    emit_result(
        {
            **result,
            "discover_one_client_p99_ms_100k": round(one_client_p99, 2),
            "clients": args.clients,
            "requests": args.clients * args.requests,
            "workers": args.workers,
        }
    )


if __name__ == "__main__":
    main()
