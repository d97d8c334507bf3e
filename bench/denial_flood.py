"""Small-upload latency under a flood of bad-token requests, ÷ the same latency without one (issue 9, class 9).

    python bench/denial_flood.py                  # PostgreSQL + S3, 1000 bad-token requests
    python bench/denial_flood.py --flood 3000

When every 401 wrote its own audit row, a thousand bad-token requests in three
seconds slowed other clients' small uploads sixfold: each refusal was a
database transaction competing with the uploads' own. Now 401s are counted in
memory and written as one row per (source, outcome) per interval, so the flood
costs the database nothing until the next flush.

Starts PostgreSQL (a fresh database), Ceph's RADOS Gateway (S3) and the store as a separate
process (``CGSTORE_AUDIT_INTERVAL_S=1`` so the aggregate rows land within the
run). Baseline: ``--uploads`` sequential 4 KiB ``PUT``s of fresh bytes with a
valid token. Then the same uploads again while ``--threads`` clients send
``--flood`` requests with garbage tokens spread over ``--seconds`` (1000 in 3 s
is the flood the hostile-client review measured); the uploads keep going until
the flood is over. Reported: the ratio of median
upload latencies (flood ÷ baseline); how many audit rows the flood wrote while
it ran; and, after one interval, whether the aggregate rows' counts sum to the
number of 401s answered.

Last line: ``{"latency_ratio": …, "baseline_ms": …, "flood_ms": …, "flood_401s": …,
"audit_rows_during_flood": …, "audited_401s": …}``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import blake3
import httpx
from _common import emit_result, log, median, production_stack
from sqlalchemy import create_engine, func, select

from cgstore.audit.models import AuditEvent

BLOB_BYTES = 4096


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flood", type=int, default=1000, help="bad-token requests (default 1000)")
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="spread the flood over this long (default 3, as found)"
    )
    parser.add_argument("--threads", type=int, default=8, help="flooding clients (default 8)")
    parser.add_argument("--uploads", type=int, default=40, help="uploads in the baseline (default 40)")
    return parser.parse_args()


def upload_once(client: httpx.Client, repo: str) -> float:
    data = os.urandom(BLOB_BYTES)
    digest = "blake3:" + blake3.blake3(data).hexdigest()
    start = time.perf_counter()
    answer = client.put(f"/v1/repos/bench/{repo}/blobs/{digest}", content=data)
    elapsed = time.perf_counter() - start
    assert answer.status_code == 201, answer.text
    return elapsed


def flood(base_url: str, total: int, threads: int, seconds: float) -> int:
    """``total`` requests with garbage tokens from ``threads`` clients, paced to last ``seconds``.

    Returns how many were answered 401.
    """
    refused = [0] * threads
    start = time.perf_counter()

    def one_client(index: int) -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            for i in range(index, total, threads):
                # Request i is due at its share of the interval (never waits once behind).
                time.sleep(max(0.0, start + seconds * i / total - time.perf_counter()))
                answer = client.get(
                    f"/v1/repos/bench/flood/blobs/blake3:{'0' * 64}",
                    headers={"Authorization": f"Bearer garbage.{i}.token"},
                )
                refused[index] += answer.status_code == 401

    workers = [threading.Thread(target=one_client, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(refused)


def audit_rows(engine) -> tuple[int, int]:
    """(rows, sum of counts) of the aggregate 401 rows."""
    with engine.connect() as conn:
        rows, counted = conn.execute(
            select(func.count(), func.coalesce(func.sum(AuditEvent.count), 0)).where(AuditEvent.action == "auth")
        ).one()
    return rows, counted


def main() -> None:
    args = parse_args()
    with production_stack("cgstore_bench_flood", audit_interval_s=1, reaper_interval_s=3600) as stack:
        token = stack.mint("bench", "bench/*:read,write")
        engine = create_engine(stack.database_url)
        with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
            for _ in range(5):  # warm up: connections, the repo row, the first S3 PUT
                upload_once(client, "baseline")
            baseline = [upload_once(client, "baseline") for _ in range(args.uploads)]
            log(f"baseline: median {median(baseline) * 1000:.1f} ms over {len(baseline)} uploads")

            time.sleep(1.5)  # let any earlier aggregate flush, so the count below is the flood's alone
            rows_before, _ = audit_rows(engine)
            done = threading.Event()
            result: dict[str, float] = {}

            def run_flood() -> None:
                start = time.perf_counter()
                result["refused"] = flood(stack.base_url, args.flood, args.threads, args.seconds)
                result["seconds"] = time.perf_counter() - start
                done.set()

            flooder = threading.Thread(target=run_flood)
            flooder.start()
            during: list[float] = []
            while not done.is_set() or len(during) < 5:
                during.append(upload_once(client, "flooded"))
            flooder.join()
            rows_during = audit_rows(engine)[0] - rows_before
        log(f"flood: {result['refused']} × 401 in {result['seconds']:.2f} s from {args.threads} clients")
        log(f"under flood: median {median(during) * 1000:.1f} ms over {len(during)} uploads")

        deadline = time.monotonic() + 10
        while audit_rows(engine)[1] < result["refused"] and time.monotonic() < deadline:
            time.sleep(0.2)
        rows_after, audited = audit_rows(engine)
        log(
            f"audit: {rows_during} aggregate rows during the flood, {rows_after - rows_before} after; "
            f"counts sum to {audited} (401s answered: {result['refused']})"
        )
        engine.dispose()

    emit_result(
        {
            "latency_ratio": round(median(during) / median(baseline), 3),
            "baseline_ms": round(median(baseline) * 1000, 2),
            "flood_ms": round(median(during) * 1000, 2),
            "flood_401s": int(result["refused"]),
            "audit_rows_during_flood": int(rows_during),
            "audited_401s": int(audited),
        }
    )


if __name__ == "__main__":
    main()
