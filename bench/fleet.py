"""A fleet booting one new declaration at once: one compile, everyone compiled soon after, yanks that reach them.

    python bench/fleet.py                 # 8 workers (~4 min on 2 cores)
    python bench/fleet.py --workers 4     # a quicker check

Starts its own PostgreSQL database, Ceph's RADOS Gateway (S3) and the store (PostgreSQL + S3) as a
separate process (claims lapse after ``--claim-ttl`` seconds), then runs N worker processes
(``bench/_fleet_worker.py``: tiny GPT-2, random weights, no hub) that share one client cache, as the
workers of one node do. Each mint child's log (``mints/<claim>.log``) starts with a
``compiling claim`` line: the compiles are counted from them.

1. **Miss**: N workers boot one new declaration at once with ``mint="on_miss"``. ``mint_s`` runs
   from the grant (the minting worker's ``minting here`` line) to its child's ``published`` line:
   export handed over, child start, compile, publish. ``all_compiled_s`` runs from the same grant to
   the last worker serving compiled; ``fleet_overhead_s`` = ``all_compiled_s - mint_s`` is what the
   fleet adds to one mint (hearing of the publish, verified download, bind). The baseline is the
   mint itself, measured in the same run.
2. **Yank**: an admin yanks the record while every worker serves it; ``yank_to_eager_p99_s`` is
   each worker's switch to eager after the yank's answer (p99 over workers; the long-poll waits
   10 s, so the bound is ``wait + 1``). A worker reports what its handle serves before each call:
   an eager call may then wait for a background confirmation still exporting the model (reported
   as a ``slow-call`` line), which is the confirmation's cost, not the yank's.
3. **Publish**: the same record is published again (its blobs from the shared cache);
   ``upgrade_after_publish_p99_s`` is each worker's switch back to compiled after the publish's answer.
4. **Takeover**: N workers boot a second new declaration; the holder's mint child is SIGKILLed
   2 s into its compile; the claim lapses and a worker takes over: ``takeover_compiles`` counts
   that declaration's compiles.

Last line: ``{"workers", "compiles", "mint_s", "all_compiled_s", "fleet_overhead_s",
"takeover_compiles", "yank_to_eager_p99_s", "upgrade_after_publish_p99_s"}``. Targets: compiles = 1,
fleet_overhead_s ≤ 10, takeover_compiles = 2, yank_to_eager_p99_s ≤ 3, upgrade_after_publish_p99_s ≤ 3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import REPO_ROOT, emit_result, log, production_stack

from cgstore_client import Client

OWNER = "bench"
WORKER = Path(__file__).resolve().parent / "_fleet_worker.py"
BOUND_S = 600
#: ``--worker-logs``: where each worker's stderr goes (its tracebacks; by default nowhere).
WORKER_LOGS: dict[str, str] = {}


class Worker:
    def __init__(self, args: list[str], env: dict[str, str], stderr_path: Path | None = None) -> None:
        self.lines: list[dict] = []
        self._changed = threading.Condition()
        stderr = open(stderr_path, "ab") if stderr_path else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), *args], env=env, stdout=subprocess.PIPE, stderr=stderr
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.process.stdout:
            with contextlib.suppress(ValueError), self._changed:
                self.lines.append(json.loads(raw))
                self._changed.notify_all()

    def first(self, predicate, timeout: float = 0.0, since: float = 0.0) -> dict | None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((line for line in self.lines if line["t"] >= since and predicate(line)), None)
                if found is not None or time.monotonic() >= deadline or self.process.poll() is not None:
                    return found
                self._changed.wait(min(1.0, max(0.01, deadline - time.monotonic())))


def compiled(line: dict) -> bool:
    return line.get("event") == "state" and line["compiled"]


def eager(line: dict) -> bool:
    return line.get("event") == "state" and not line["compiled"]


def minting(line: dict) -> bool:
    return (line.get("reason") or "").startswith("minting here")


def mint_logs(cache: Path) -> list[list[str]]:
    folder = cache / "mints"
    logs = sorted(folder.glob("*.log")) if folder.exists() else []
    return [text.splitlines() for text in (p.read_text() for p in logs) if "compiling claim" in text]


def logged_at(lines: list[str], marker: str) -> float | None:
    return next((float(line.split(" ", 1)[0]) for line in lines if marker in line), None)


#: A worker's upgrade, as its client logs it (``worker.fleet.Follower``).
UPGRADED = re.compile(
    r"now serves \S+ from \S+ compiled \((?P<s>[0-9.]+) s(?P<heard> since the publish was heard)?: (?P<steps>[^;]*);"
)


def upgrades(fleet: Fleet, since: float, answered: float) -> list[str]:
    """Each worker's upgrade after ``since``, step by step: when it heard the publish (after its answer), the
    discover, the blobs (receipt, cache or download), the load and bind, and the switch seen by its next call."""
    rows = []
    for worker in fleet.workers:
        logged = worker.first(lambda line: line.get("event") == "log" and UPGRADED.search(line["message"]), 0, since)
        seen = worker.first(compiled, 0, since)
        if logged is None or seen is None:
            continue
        match = UPGRADED.search(logged["message"])
        took = float(match["s"])
        heard = f"heard +{logged['t'] - took - answered:.2f}s" if match["heard"] else "no event heard"
        rows.append(
            f"pid {worker.process.pid}: {heard}, switched {took:.2f}s later ({match['steps']}), "
            f"seen by its next call {seen['t'] - logged['t']:+.2f}s"
        )
    return rows


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Fleet:
    def __init__(self, url: str, token: str, repo: str, family: str, scratch: Path) -> None:
        self.cache = scratch / f"cache-{family}"
        self.stop = scratch / f"stop-{family}"
        env = {**os.environ, "CGSTORE_TOKEN": token}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "store"), str(REPO_ROOT / "client"), str(REPO_ROOT)])
        self.args = [url, repo, family, str(self.cache), str(self.stop)]
        self.env = env
        self.workers: list[Worker] = []

    def start(self, count: int) -> None:
        logs = WORKER_LOGS.get("dir")
        self.workers = [
            Worker(self.args, self.env, Path(logs) / f"{self.stop.name}-worker-{i}.log" if logs else None)
            for i in range(count)
        ]

    def all_compiled(self, since: float = 0.0) -> list[dict]:
        served = [w.first(compiled, BOUND_S, since) for w in self.workers]
        if not all(served):
            raise SystemExit(f"not every worker compiled: {[w.lines[-3:] for w in self.workers]}")
        return served

    def close(self) -> None:
        self.stop.touch()
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(15)
            if worker.process.poll() is None:
                worker.process.kill()


def miss(fleet: Fleet, workers: int) -> dict[str, float]:
    fleet.start(workers)
    served = fleet.all_compiled()
    (lines,) = mint_logs(fleet.cache) or [[]]
    granted = min(line["t"] for w in fleet.workers for line in w.lines if minting(line))
    published = logged_at(lines, "published ")
    mint_s = published - granted
    all_compiled_s = max(line["t"] for line in served) - granted
    log(
        f"miss: {len(mint_logs(fleet.cache))} compile(s), mint {mint_s:.1f}s, all {workers} compiled {all_compiled_s:.1f}s"
    )
    for row in upgrades(fleet, granted, published):
        log(f"  upgrade {row}")
    return {
        "compiles": len(mint_logs(fleet.cache)),
        "mint_s": round(mint_s, 2),
        "all_compiled_s": round(all_compiled_s, 2),
        "fleet_overhead_s": round(all_compiled_s - mint_s, 2),
    }


def yank_and_publish(stack, fleet: Fleet, repo: str, token: str, scratch: Path) -> dict[str, float]:
    key = fleet.workers[0].first(compiled)["key"]
    with Client(stack.base_url, token, cache_dir=fleet.cache) as client:
        record = client.read_record(repo, key)
        manifest = record["manifest"]
        archive = scratch / "republish.pt2"
        shutil.copy(client.fetch_blob(repo, manifest["artifact"]["digest"]), archive)
        components = {c["name"]: client.fetch_blob(repo, c["digest"]) for c in manifest["components"]}
    admin = stack.mint("bench-admin", "*/*:admin")
    with Client(stack.base_url, admin, cache_dir=scratch / "admin-cache") as client:
        yanked_at = time.time()
        client.transport.request("POST", f"/v1/repos/{repo}/compiled-graphs/{key}:yank", json={"reason": "bench"})
        answered = time.time()
    went_eager = [w.first(eager, 60, yanked_at) for w in fleet.workers]
    if not all(went_eager):
        raise SystemExit(f"not every worker went eager after the yank: {[w.lines[-2:] for w in fleet.workers]}")
    yank_s = [max(0.0, line["t"] - answered) for line in went_eager]  # a switch may beat the answer home
    with Client(stack.base_url, token, cache_dir=scratch / "republish-cache") as client:
        published_at = time.time()
        client.publish(
            repo,
            archive,
            family=manifest["family"],
            envelope=manifest["axes"]["envelope"],
            toolchain={**manifest["axes"]["toolchain"]["components"], **manifest["axes"]["toolchain"]["recorded"]},
            sm=manifest["axes"]["sm"],
            components=components,
            release=manifest.get("release"),
            code=manifest.get("code"),
        )
        answered = time.time()
    upgrade_s = [max(0.0, line["t"] - answered) for line in fleet.all_compiled(published_at)]
    log(f"yank → eager: max {max(yank_s):.2f}s; publish → compiled: max {max(upgrade_s):.2f}s")
    for row in upgrades(fleet, published_at, answered):
        log(f"  upgrade {row}")
    return {"yank_to_eager_p99_s": round(p99(yank_s), 2), "upgrade_after_publish_p99_s": round(p99(upgrade_s), 2)}


def takeover(fleet: Fleet, workers: int) -> int:
    fleet.start(workers)
    deadline = time.monotonic() + BOUND_S
    while not mint_logs(fleet.cache):
        if time.monotonic() > deadline:
            raise SystemExit("no mint started")
        time.sleep(0.1)
    time.sleep(2)  # inside the compile
    (lines,) = mint_logs(fleet.cache)
    os.kill(int(lines[0].rsplit("(pid ", 1)[1].rstrip(")")), signal.SIGKILL)
    fleet.all_compiled()
    compiles = len(mint_logs(fleet.cache))
    log(f"takeover: {compiles} compiles, all {workers} compiled")
    return compiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--claim-ttl", type=float, default=15.0)
    parser.add_argument("--worker-logs", help="a directory for each worker's stderr (default: discarded)")
    args = parser.parse_args()
    if args.worker_logs:
        os.makedirs(args.worker_logs, exist_ok=True)
        WORKER_LOGS["dir"] = args.worker_logs
    started = time.perf_counter()
    result: dict[str, float] = {"workers": args.workers}
    with (
        tempfile.TemporaryDirectory(prefix="cgstore-bench-fleet-") as scratch_dir,
        production_stack(claim_ttl_s=args.claim_ttl) as stack,
    ):
        scratch = Path(scratch_dir)
        suffix = os.urandom(4).hex()
        repo = f"{OWNER}/fleet-{suffix}"
        token = stack.mint("bench-fleet", f"{repo}:read,write")
        first = Fleet(stack.base_url, token, repo, f"gpt2-fleet-{suffix}", scratch)
        try:
            result.update(miss(first, args.workers))
            result.update(yank_and_publish(stack, first, repo, token, scratch))
        finally:
            first.close()
        # Another repo: the same graph is the same key, which the first repo already holds under its family.
        other = f"{OWNER}/takeover-{suffix}"
        second = Fleet(
            stack.base_url, stack.mint("bench-fleet", f"{other}:read,write"), other, f"gpt2-takeover-{suffix}", scratch
        )
        try:
            result["takeover_compiles"] = takeover(second, args.workers)
        finally:
            second.close()
    ordered = [
        "workers",
        "compiles",
        "mint_s",
        "all_compiled_s",
        "fleet_overhead_s",
        "takeover_compiles",
        "yank_to_eager_p99_s",
        "upgrade_after_publish_p99_s",
    ]
    log(f"total {time.perf_counter() - started:.0f}s, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    emit_result({name: result[name] for name in ordered})


if __name__ == "__main__":
    main()
