"""Admin console page latency at 100 k live records and 1 M audit entries, on both configurations.

    python bench/console.py                                   # both configurations, full scale (~6 min)
    CGSTORE_BENCH_CONSOLE_SCALE=0.05 python bench/console.py  # 5 k records, 50 k audit entries (~1.5 min)
    python bench/console.py --configs production --rounds 20

For each configuration (``embedded``: the store alone, SQLite + the blob
directory; ``production``: PostgreSQL + Ceph's RADOS Gateway) it starts the store as a
separate process (``_common.py``), seeds its database in bulk
(``_console_seed.py``: live records over 20 repos, 8 families, 4 sms, 3 lanes,
30 publishers; a chained audit log of mixed actions, outcomes, actors and
aggregated 401 rows), signs in to the console with an admin token (``POST
/console/login``, ``*/*:admin``) and then, ``--rounds`` times, asks for every
page once in turn over one keep-alive connection: the overview, records
(unfiltered, by family, by repo, a later keyset page), one record, the audit log
(unfiltered; by an action prefix that is common (``token.*``), rare (``key.*``,
10 entries in 1 M), spans two actions (``GET *``) or matches nothing; by actor;
a later page), tokens and storage.
The baseline is ``GET /healthz`` on the same store, asked in the same rounds.

The store's whole-registry aggregates (overview, storage) are kept for
``CGSTORE_CONSOLE_AGGREGATES_S`` (``--aggregates-s``, default the deployment's
30 s); 300 rounds take a minute or more, so they expire and are recomputed
(in the background) at least once while the pages are measured, and the
recomputation's work shows in the percentiles. ``--aggregates-s 5`` recomputes
them almost all the time.

Details (a table per configuration) go to earlier lines; the last line is
``{"worst_p95_ms", "worst_page", "budget_ratio", ...}``: the slowest page's p95
over both configurations and its ratio to the 100 ms budget (≤ 1 meets it);
per configuration the worst p95, its page, the slowest single answer of any
page (``*_max_ms``: a view that waited for the aggregates shows there) and the
baseline's p50.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from html import unescape

import httpx
from _common import embedded_stack, emit_result, log, production_stack
from _console_seed import fake_key, record_repo, seed

BUDGET_MS = 100.0
FULL_RECORDS = 100_000
FULL_AUDIT = 1_000_000
#: Pages followed by ``rel="next"`` to reach "a later page".
LATER = 10
_NEXT = re.compile(r'<a rel="next" href="([^"]+)"')
_FIGURES_AS_OF = re.compile(r'Figures as of <time datetime="([^"]+)"')


def parse_args() -> argparse.Namespace:
    scale = float(os.environ.get("CGSTORE_BENCH_CONSOLE_SCALE", "1"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--records",
        type=int,
        default=int(FULL_RECORDS * scale),
        help="live records (default 100000 × CGSTORE_BENCH_CONSOLE_SCALE)",
    )
    parser.add_argument(
        "--audit",
        type=int,
        default=int(FULL_AUDIT * scale),
        help="audit entries (default 1000000 × CGSTORE_BENCH_CONSOLE_SCALE)",
    )
    parser.add_argument("--rounds", type=int, default=300, help="measured requests of each page (default 300)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured rounds first (default 3)")
    parser.add_argument(
        "--aggregates-s",
        type=float,
        default=30.0,
        help="CGSTORE_CONSOLE_AGGREGATES_S of the measured store (default 30, the deployment default)",
    )
    parser.add_argument("--configs", default="embedded,production", help="comma-separated (default both)")
    return parser.parse_args()


def sign_in(client: httpx.Client, token: str) -> None:
    answer = client.post("/console/login", data={"token": token})
    if answer.status_code != 303 or "cgstore_console" not in client.cookies:
        raise SystemExit(f"console sign-in failed: {answer.status_code} {answer.text[:200]}")


def later_page(client: httpx.Client, path: str) -> str:
    """The URL ``LATER`` pages on from ``path``, by its ``rel="next"`` links."""
    for _ in range(LATER):
        answer = client.get(path)
        found = _NEXT.search(answer.text)
        if answer.status_code != 200 or found is None:
            raise SystemExit(f"no next page after {path}: {answer.status_code}")
        path = unescape(found.group(1))
    return path


def pages(client: httpx.Client, records: int) -> dict[str, str]:
    middle = records // 2
    owner, name = record_repo(middle)
    return {
        "overview": "/console",
        "records": "/console/records",
        "records ?family": "/console/records?family=sdxl",
        "records ?repo": f"/console/records?repo={owner}/{name}",
        f"records, page {LATER + 1}": later_page(client, "/console/records"),
        "record": f"/console/records/{owner}/{name}/{fake_key(middle)}",
        "audit": "/console/audit",
        "audit ?action=token.*": "/console/audit?action=token.*",
        "audit ?action=key.*": "/console/audit?action=key.*",
        "audit ?action=GET *": "/console/audit?action=GET%20*",
        "audit ?action=none.*": "/console/audit?action=none.*",
        "audit ?actor": "/console/audit?actor=user-17",
        f"audit, page {LATER + 1}": later_page(client, "/console/audit"),
        "tokens": "/console/tokens",
        "storage": "/console/storage",
    }


def measure(client: httpx.Client, paths: dict[str, str], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Every page once per round, in turn; milliseconds per page (``healthz`` the baseline)."""
    every = {"healthz (baseline)": "/healthz", **paths}
    times: dict[str, list[float]] = {name: [] for name in every}
    computed: dict[str, set[str]] = {}  # the distinct "Figures as of" times each aggregate page showed
    for round_ in range(warmup + rounds):
        for name, path in every.items():
            started = time.perf_counter()
            answer = client.get(path)
            elapsed = (time.perf_counter() - started) * 1000
            if answer.status_code != 200:
                raise SystemExit(f"{name} ({path}) answered {answer.status_code}: {answer.text[:300]}")
            if round_ >= warmup:
                times[name].append(elapsed)
                if found := _FIGURES_AS_OF.search(answer.text):
                    computed.setdefault(name, set()).add(found.group(1))
    for name, moments in computed.items():
        log(f"  {name}: figures of {len(moments)} computations shown while measuring")
    return times


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def run(config: str, args: argparse.Namespace) -> dict[str, tuple[float, float, float]]:
    """{page: (p50, p95, max)} for one configuration."""
    start = embedded_stack if config == "embedded" else production_stack
    settings = {"console_aggregates_s": args.aggregates_s, "reaper_interval_s": 3600}
    with start(**settings) as stack:
        database_url = (
            getattr(stack, "database_url", None) or f"sqlite:///{(stack.home / 'cgstore.sqlite3').absolute()}"
        )
        log(f"== {config}: {args.records} records, {args.audit} audit entries")
        seed(database_url, args.records, args.audit, log=log)
        token = stack.mint("bench-admin", "*/*:admin")
        with httpx.Client(base_url=stack.base_url, timeout=60) as client:
            sign_in(client, token)
            paths = pages(client, args.records)
            started = time.perf_counter()
            times = measure(client, paths, args.rounds, args.warmup)
            log(f"  measured {args.rounds} rounds in {time.perf_counter() - started:.1f} s")
            others = measure_others(client, token)
    figures = {name: (statistics.median(v), percentile(v, 0.95), max(v)) for name, v in times.items()}
    log(f"  {'page':<24} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
    for name, (p50, p95, most) in figures.items():
        log(f"  {name:<24} {p50:8.1f} {p95:8.1f} {most:8.1f}")
    log(f"  not in the budget (median of {OTHER_ROUNDS}):")
    for name, ms in others.items():
        log(f"  {name:<40} {ms:8.1f}")
    return figures


#: Requests of each route outside the budget.
OTHER_ROUNDS = 5


def measure_others(client: httpx.Client, token: str) -> dict[str, float]:
    """Median milliseconds of routes the budget does not cover: the JSON stats."""
    routes = {
        "GET /v1/admin/stats (JSON)": ("/v1/admin/stats", {"Authorization": f"Bearer {token}"}),
    }
    figures = {}
    for name, (path, headers) in routes.items():
        times = []
        for _ in range(OTHER_ROUNDS):
            started = time.perf_counter()
            answer = client.get(path, headers=headers)
            times.append((time.perf_counter() - started) * 1000)
            if answer.status_code != 200:
                raise SystemExit(f"{name} answered {answer.status_code}: {answer.text[:300]}")
        figures[name] = statistics.median(times)
    return figures


def main() -> None:
    args = parse_args()
    result: dict[str, object] = {}
    worst = ("", "", 0.0)
    for config in args.configs.split(","):
        figures = run(config, args)
        baseline = figures.pop("healthz (baseline)")
        page, (_, p95, _) = max(figures.items(), key=lambda item: item[1][1])
        result[f"{config}_worst_p95_ms"] = round(p95, 1)
        result[f"{config}_worst_page"] = page
        result[f"{config}_max_ms"] = round(max(most for _, _, most in figures.values()), 1)
        result[f"{config}_baseline_p50_ms"] = round(baseline[0], 2)
        if p95 >= worst[2]:
            worst = (config, page, p95)
    emit_result(
        {
            "worst_p95_ms": round(worst[2], 1),
            "worst_page": f"{worst[0]}: {worst[1]}",
            "budget_ratio": round(worst[2] / BUDGET_MS, 3),
            **result,
            "records": args.records,
            "audit_entries": args.audit,
            "rounds": args.rounds,
        }
    )


if __name__ == "__main__":
    main()
