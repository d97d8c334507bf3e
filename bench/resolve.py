"""Batch resolve latency with 1 k and with 100 k records: does it stay flat as the table grows?

    python bench/resolve.py                      # 16 clients, 1 k then 100 k records
    python bench/resolve.py --clients 4 --requests 40
    python bench/resolve.py --workers 1          # one store process (default 2: CGSTORE_WORKERS)

Starts its own PostgreSQL database, moto_server and the store (PostgreSQL + S3,
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

Last line: ``{"p50_ms_1k", "p99_ms_1k", "p50_ms_100k", "p99_ms_100k", "p99_ratio"}``
(ratio = 100 k ÷ 1 k), plus the client count, request count and store processes it was taken with.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import threading
import time

import httpx
from sqlalchemy import create_engine, text

from _common import emit_result, log, production_stack

FAMILY = "bench-family"
KEYS_PER_REQUEST = 256
HITS_PER_REQUEST = 128
SEED_BATCH = 5000


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument("--requests", type=int, default=40, help="measured requests per client per size (default 40)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured requests per client first (default 3)")
    parser.add_argument("--small", type=int, default=1_000, help="records in the first measurement (default 1000)")
    parser.add_argument("--workers", type=int, default=2, help="store processes, CGSTORE_WORKERS (default 2: one per core)")
    parser.add_argument("--large", type=int, default=100_000, help="records in the second (default 100000)")
    return parser.parse_args()


def fake_digest(kind: str, n: int) -> str:
    return "blake3:" + f"{kind}{n:x}".encode().hex().ljust(64, "0")[:64]


def fake_key(n: int) -> str:
    return "ck1-" + f"{n:056x}"


def seed(database_url: str, start: int, stop: int) -> None:
    """Records ``start..stop-1`` in ``root/bench-family``, each with its own artifact and one shared component."""
    engine = create_engine(database_url)
    now = dt.datetime.now(dt.UTC)
    component = fake_digest("c", 0)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO repos (owner, name, visibility, created_by, created_at) "
            "VALUES ('root', 'bench-family', 'owner', 'bench', :now) ON CONFLICT DO NOTHING"), {"now": now})
        repo_id = conn.execute(text("SELECT id FROM repos WHERE owner='root' AND name='bench-family'")).scalar()
        conn.execute(text("INSERT INTO blobs (digest, size, created_at, linked_at) VALUES (:d, 28, :now, :now) ON CONFLICT DO NOTHING"),
                     {"d": component, "now": now})
    for low in range(start, stop, SEED_BATCH):
        high = min(low + SEED_BATCH, stop)
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO blobs (digest, size, created_at, linked_at) VALUES (:d, 1565188, :now, :now)"),
                         [{"d": fake_digest("a", n), "now": now} for n in range(low, high)])
            conn.execute(text(_INSERT_RECORD), [_record(repo_id, n, now) for n in range(low, high)])
            conn.execute(text(
                "INSERT INTO compiled_graph_components (record_id, name, digest, size) "
                "SELECT id, 'consts', :c, 28 FROM compiled_graphs WHERE repo_id = :r AND id > :after"),
                {"c": component, "r": repo_id, "after": _max_component_record(conn)})
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
    "created_at, health"
)
_INSERT_RECORD = f"INSERT INTO compiled_graphs ({_COLUMNS}) VALUES ({', '.join(':' + c.strip() for c in _COLUMNS.split(','))})"
_KERNEL_LANE = json.dumps({"winner": "baseline+packed", "rule": "fit-constrained-speed/1", "binding": "speed",
                           "margin_fraction": 0.05, "candidates": ["baseline+dense", "baseline+packed"], "fit": None})


def _record(repo_id: int, n: int, now: dt.datetime) -> dict:
    return {
        "repo_id": repo_id, "key": fake_key(n), "kind": "aot-inductor", "format": "pt2", "family": FAMILY,
        "lane": "baseline+packed", "sm": "sm_90", "graph_digest": fake_digest("g", n),
        "envelope": json.dumps({"v": 1, "shapes": [[1024, 1024]], "text_len": 512, "guidance": ["3.5"],
                                "batch_sizes": [1]}),
        "envelope_digest": fake_digest("e", n), "toolchain": json.dumps({"v": 1, "components": {"torch": "2.13.0"}}),
        "toolchain_digest": fake_digest("t", 0), "recorded_versions": "{}",
        "artifact_digest": fake_digest("a", n), "artifact_size": 1565188, "component_set": fake_digest("s", 0),
        "layout_display": "flux2.diffusers@1+cozy.fp8-rowwise@1", "layout_topology": fake_digest("l", 0),
        "layout_quant": fake_digest("q", 0), "input_contract": json.dumps({"v": 1, "inputs": [], "dims": {}}),
        "binding_table": "[]", "kernel_lane": _KERNEL_LANE, "publisher": "bench", "publisher_jti": None,
        "created_at": now, "health": "ok",
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


def check_answer(base_url: str, token: str, body: bytes) -> None:
    answer = httpx.post(f"{base_url}/v1/compiled-graphs:resolve", content=body,
                        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"}).json()
    hits = [a for a in answer["answers"] if a["status"] == "hit"]
    assert len(hits) == HITS_PER_REQUEST, f"{len(hits)} hits"
    assert hits[0]["artifact"]["url"].startswith("http") and "X-Amz-Signature" in hits[0]["artifact"]["url"]


def measure(base_url: str, token: str, bodies: list[bytes], clients: int, requests: int, warmup: int) -> list[float]:
    """Latencies (ms) of ``clients`` x ``requests`` resolves sent back to back by ``clients`` threads."""
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
                response = http.post("/v1/compiled-graphs:resolve", content=body)
                response.read()
                elapsed = (time.perf_counter() - started) * 1000
                if response.status_code != 200:
                    raise RuntimeError(f"resolve answered {response.status_code}: {response.text[:200]}")
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


def run_size(stack, token: str, records: int, args, rng: random.Random) -> tuple[float, float]:
    bodies = request_bodies(records, 64, rng)
    check_answer(stack.base_url, token, bodies[0])
    started = time.perf_counter()
    latencies = measure(stack.base_url, token, bodies, args.clients, args.requests, args.warmup)
    wall = time.perf_counter() - started
    p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
    log(f"{records:>7} records: {len(latencies)} resolves by {args.clients} clients in {wall:.1f} s "
        f"({len(latencies) / wall:.0f}/s): p50 {p50:.1f} ms, p90 {percentile(latencies, 0.9):.1f} ms, "
        f"p99 {p99:.1f} ms, max {max(latencies):.1f} ms")
    return p50, p99


def main() -> None:
    args = parse_args()
    rng = random.Random(20261203)
    with production_stack("cgstore_bench_resolve", redirect_downloads=True, reaper_interval_s=3600,
                          workers=args.workers) as stack:
        token = stack.mint("bench-worker", "bench/*:read")
        started = time.perf_counter()
        seed(stack.database_url, 0, args.small)
        log(f"seeded {args.small} records in {time.perf_counter() - started:.1f} s")
        p50_small, p99_small = run_size(stack, token, args.small, args, rng)
        started = time.perf_counter()
        seed(stack.database_url, args.small, args.large)
        log(f"seeded {args.large - args.small} more records in {time.perf_counter() - started:.1f} s")
        p50_large, p99_large = run_size(stack, token, args.large, args, rng)
    emit_result({
        "p50_ms_1k": round(p50_small, 2), "p99_ms_1k": round(p99_small, 2),
        "p50_ms_100k": round(p50_large, 2), "p99_ms_100k": round(p99_large, 2),
        "p99_ratio": round(p99_large / p99_small, 3),
        "clients": args.clients, "requests": args.clients * args.requests, "workers": args.workers,
    })


if __name__ == "__main__":
    main()
