"""Misses, once per fleet (issue 26 §3, §5): real worker processes, real torch, a real store.

Each worker (``tests/fleet/worker.py``) is its own process booting the tiny
model by declaration with ``mint="on_miss"``; the workers of a fleet share one
client cache, as the workers of one node do, so every mint child's log
(``mints/<claim>.log``, first line ``<time> compiling claim …``) is a mint
the test can count and time. Every scenario runs on both configurations
(``configuration``: embedded, then production), each on its own two stores:

- six workers mint a new declaration once; then, the same processes and a
  mandatory worker serving it, yanks and publishes reach them all (the
  publishes are the session's archive A, the very graph the workers export);
- two fleets at once on a store with a short claim TTL and a short backoff:
  one meets a mint child killed, then a holder worker killed (each a takeover:
  two mints each, three in all), the other a graph that cannot compile (five
  failed mints in seconds).

A configuration's fleets start together (``started_together``): one's mints
run while the other's workers wait out a TTL or a backoff.

An AOTInductor compile costs 10-40 s here, and every mint of these fleets
compiles the same graph (archive A's): the mint children of the six-worker and
takeover fleets take the compile from the session's compile memo
(``tests/fleet/memo.py``, seeded with archive A), so the suite adds no real
compile. The mints are still counted one by one: a mint child started is a
mint, whatever its compile cost.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cgstore.cli import app
from cgstore_client import Client
from cgstore_client.binding import code_fingerprint
from cgstore_client.environment import environment_sm, environment_toolchain
from cgstore_client.mint import derived_constants_path
from tests.fleet import memo
from tests.fleet.declaration import ENVELOPE
from tests.support.archives import REPO, tiny_model
from tests.support.live_store import running_store, session_servers, settings_for, unique_repo

pytestmark = pytest.mark.torch

#: A compile (and a takeover's second one) on a loaded 2-core machine, with workers importing torch.
MINT_BOUND_S = 240
#: Five failed mints and four backoffs: five mint children each starting and importing torch (30-60 s each at a
#: load average of 25 on the 2 cores), the backoffs hidden behind them. A bound: a quiet machine takes ~40 s.
FAILING_BOUND_S = 420
#: What the issue allows past the mint for every worker to be compiled.
FLEET_SLACK_S = 10
EVENTS_WAIT_S = 5
#: How long the six workers' mint still compiles once they have all booted (from the memo: a compile's tail).
COMPILE_AFTER_BOOTS_S = 5
#: The takeover fleets' claim TTL: a killed holder's claim lapses this soon (a live one is beaten every third).
CLAIM_TTL_S = 5
#: The failing fleet's first backoff, then doubling (22.5 s in all, hidden behind the takeovers' compiles): the
#: fourth (12 s) outlasts any mint child's exit and its worker's next claim, so a worker is told ``backoff``.
CLAIM_BACKOFF_S = 1.5


class Worker:
    """One worker process and the JSON lines it printed (each with the time it saw it)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.lines: list[dict] = []
        self._changed = threading.Condition()
        self._stderr = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet.worker", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.process.stdout:
            with contextlib.suppress(ValueError), self._changed:
                self.lines.append(json.loads(raw))
                self._changed.notify_all()

    def first(self, predicate, timeout: float = 0.0) -> dict | None:
        """The first line matching ``predicate``, waiting up to ``timeout`` seconds for it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((line for line in self.lines if predicate(line)), None)
                if found is not None or time.monotonic() >= deadline or self.process.poll() is not None:
                    return found
                self._changed.wait(min(1.0, max(0.01, deadline - time.monotonic())))

    def after(self, moment: float, predicate, timeout: float) -> dict | None:
        return self.first(lambda line: line["t"] >= moment and predicate(line), timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        self._stderr.close()


class Fleet:
    """Workers of one declaration against one store, one shared cache, one stop file."""

    def __init__(
        self,
        store,
        tmp_path: Path,
        env: dict[str, str] | None = None,
        compile_memo: Path | None = None,
        gated: bool = False,
    ):
        """``compile_memo``: the mint children take their compile from it (``tests/fleet/memo.py``), which
        answers (``gated``) only once the test creates ``gate``."""
        self.store, self.tmp_path = store, tmp_path
        self.repo, self.family = f"acme/{unique_repo('fleet')}", unique_repo("tiny-fleet")
        self.token = store.mint("fleet-workers", f"{self.repo}:read,write")
        self.cache = tmp_path / "cache"
        self.stop_file = tmp_path / "stop"
        paths = [str(REPO / "store"), str(REPO / "client"), str(REPO)]
        self.env = {**os.environ, "CGSTORE_TOKEN": self.token, "PYTHONPATH": os.pathsep.join(paths), **(env or {})}
        self.env.pop(memo.MEMO_ENV, None)
        self.env.pop(memo.GATE_ENV, None)
        self.gate = tmp_path / "compile-gate"
        if gated:
            self.env[memo.GATE_ENV] = str(self.gate)
        if compile_memo is not None:
            self.env[memo.MEMO_ENV] = str(compile_memo)
            self.env["PYTHONPATH"] = os.pathsep.join([str(memo.SITE), *paths])
        self.workers: list[Worker] = []

    def start(self, count: int, *extra: str) -> list[Worker]:
        started = []
        for _ in range(count):
            args = ["--url", self.store.base_url, "--repo", self.repo, "--family", self.family]
            args += ["--cache", str(self.cache), "--stop", str(self.stop_file), "--events-wait", str(EVENTS_WAIT_S)]
            log = self.tmp_path / f"worker-{len(self.workers)}.log"
            started.append(Worker([*args, *extra], self.env, log))
            self.workers.extend(started[-1:])
        return started

    def mint_logs(self) -> list[list[str]]:
        """Every mint child's log, as lines: one per compile started."""
        logs = sorted((self.cache / "mints").glob("*.log")) if (self.cache / "mints").exists() else []
        return [path.read_text().splitlines() for path in logs if "compiling claim" in path.read_text()]

    def wait_for_a_compile(self, timeout: float = 180) -> list[str]:
        """The first mint child's log, once it has started."""
        deadline = time.monotonic() + timeout
        while not (logs := self.mint_logs()):
            assert time.monotonic() < deadline, "no compile started"
            time.sleep(0.05)
        return logs[0]

    def records(self) -> list[dict]:
        with self.store.client(self.token) as client:
            answer = client.get(f"/v1/repos/{self.repo}/compiled-graphs", params={"family": self.family})
        assert answer.status_code == 200, answer.text
        return answer.json()["records"]

    def close(self) -> None:
        self.stop_file.touch()  # every worker leaves at once; then each is waited for
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(10)
            worker.stop()


def first_of(workers: list[Worker], predicate, timeout: float) -> dict | None:
    """The first line matching ``predicate`` of any of ``workers``, waiting up to ``timeout`` seconds for one."""
    deadline = time.monotonic() + timeout
    while True:
        found = next((line for w in workers if (line := w.first(predicate))), None)
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def logged_at(lines: list[str], marker: str) -> float | None:
    """The Unix time of the first log line saying ``marker``."""
    return next((float(line.split(" ", 1)[0]) for line in lines if marker in line), None)


def compiled(line: dict) -> bool:
    return line.get("event") == "state" and line["compiled"]


def eager(line: dict) -> bool:
    return line.get("event") == "state" and not line["compiled"]


def reason(line: dict) -> str:
    return line.get("reason") or ""


@contextlib.contextmanager
def store_for_the_module(request, tmp_path_factory, configuration: str, **settings):
    home = tmp_path_factory.mktemp(f"fleet-{configuration}")
    servers = session_servers(request, configuration)
    with running_store(settings_for(configuration, home, **servers, **settings), configuration) as store:
        yield store


@pytest.fixture(scope="module", params=["embedded", "production"])
def configuration(request) -> str:
    """Every scenario on both configurations: the module's tests run for one, then for the other."""
    return request.param


@pytest.fixture(scope="module")
def compile_memo(tmp_path_factory, pt2_archive) -> Path:
    """The compile memo of both configurations' mints, seeded with archive A (the graph the workers export)."""
    directory = tmp_path_factory.mktemp("compile-memo")
    memo.seed(directory, pt2_archive)
    return directory


@pytest.fixture(scope="module", autouse=True)
def started_together(request, configuration):
    """The takeover and failing fleets start first (their waits are long), then the six workers'."""
    request.getfixturevalue("troubled")
    request.getfixturevalue("served")


# --- six workers, one compile; then yanks and publishes reach the same processes ------------------------


class Served:
    """Six workers booting a new declaration, a mandatory one booting once it is served."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        # One of them confirms each record it upgrades to in the background, as workers do by default; the
        # others skip it (an export each time: CPU this machine lacks, and confirmation has tests of its own).
        self.six = fleet.start(1, "--confirm", "background") + fleet.start(5)
        self.published = fleet.tmp_path / "published"
        (self.mandatory,) = fleet.start(1, "--mandatory", "--boot-after", str(self.published))
        threading.Thread(target=self._open_the_gate, daemon=True).start()

    def _open_the_gate(self) -> None:
        """The mint's compile (from the memo) ends a few seconds after all six have booted, as a real one
        (20-40 s) would: each worker meets the mint in flight and waits for it as a fleet does."""
        deadline = time.monotonic() + MINT_BOUND_S
        while not all(w.first(lambda line: line.get("event") == "booted") for w in self.six):
            if time.monotonic() > deadline or any(w.process.poll() is not None for w in self.six):
                break
            time.sleep(0.05)
        time.sleep(COMPILE_AFTER_BOOTS_S)
        self.fleet.gate.touch()

    def six_compiled(self) -> list[dict | None]:
        served = [worker.first(compiled, MINT_BOUND_S) for worker in self.six]
        self.published.touch()  # the mandatory worker boots now, on a hit
        return served


@pytest.fixture(scope="module")
def served(request, tmp_path_factory, configuration, compile_memo):
    with store_for_the_module(request, tmp_path_factory, configuration) as store:
        fleet = Fleet(store, tmp_path_factory.mktemp("served"), compile_memo=compile_memo, gated=True)
        try:
            yield Served(fleet)
        finally:
            fleet.close()


def test_six_workers_booting_one_new_declaration_compile_it_once_and_all_serve_it(served):
    fleet, workers = served.fleet, served.six
    lines = served.six_compiled()
    assert all(lines), [w.lines for w in workers]
    (log,) = fleet.mint_logs()  # one claim granted, one compile
    published_at = logged_at(log, "published ")
    assert published_at is not None, log
    # Every worker compiled within the mint's end + 10 s, serving what its eager model computes.
    assert max(line["t"] for line in lines) <= published_at + FLEET_SLACK_S, [
        line["t"] - published_at for line in lines
    ]
    assert all(line["equal"] for line in lines)
    minting = [w for w in workers if w.first(lambda line: reason(line).startswith("minting here (claim "))]
    waiting = [w for w in workers if w.first(lambda line: reason(line).startswith("waiting for a mint (claim "))]
    assert len(minting) == 1 and len(minting) + len(waiting) == 6
    (record,) = fleet.records()  # one record
    assert {line["key"] for line in lines} == {record["key"]}
    # The minting worker's own graph is confirmed without a second export.
    assert minting[0].first(compiled)["confirmation"] == "confirmed"


def test_a_yank_reaches_every_running_worker_and_a_publish_upgrades_them_again(served, pt2_archive, tmp_path):
    fleet, workers = served.fleet, [*served.six, served.mandatory]
    assert all(served.six_compiled()), [w.lines for w in served.six]
    assert served.mandatory.first(compiled, 120), served.mandatory.lines
    (minted,) = fleet.records()
    admin = fleet.store.mint("fleet-admin", "*/*:admin")
    publish = _publisher(fleet, pt2_archive, tmp_path)
    confirming = served.six[0]  # confirms in the background: an export of its model measures the graph
    assert confirming.first(lambda line: compiled(line) and line["confirmation"] == "confirmed", 120), confirming.lines

    _yank_reaches_every_worker(served, admin, minted["key"], "bad numerics")
    published_at = time.time()
    key = publish()  # another mint's record of the declaration: the eager fleet upgrades to it
    _every_worker_upgrades(workers, published_at, key)
    # The graph its model was measured to export is known: confirmed on the switch, no export again.
    assert confirming.after(published_at, compiled, 0)["confirmation"] == "confirmed", confirming.lines

    _yank_reaches_every_worker(served, admin, key, "bad numerics again")
    republished_at = time.time()
    assert publish() == key  # a yanked key can be published again, and upgrades them again
    _every_worker_upgrades(workers, republished_at, key)
    assert len(fleet.mint_logs()) == 1  # a yank starts no mint: the fleet waited for a publish


def _yank_reaches_every_worker(served: Served, admin: str, key: str, why: str) -> None:
    """Yank ``key``: every plain worker eager within the long-poll's wait + 1 s, the mandatory one raising."""
    yanked_at = time.time()
    with served.fleet.store.client(admin) as client:
        answer = client.post(f"/v1/repos/{served.fleet.repo}/compiled-graphs/{key}:yank", json={"reason": why})
    assert answer.status_code == 200, answer.text
    went = [w.after(yanked_at, eager, 30) for w in served.six]
    assert all(went), [w.lines for w in served.six]
    assert all(reason(line) == f"yanked: {why}" for line in went)
    assert max(line["t"] for line in went) <= yanked_at + EVENTS_WAIT_S + 1
    raised = served.mandatory.after(yanked_at, lambda line: line.get("event") == "raised", 30)
    assert raised and raised["at"] == "call" and raised["t"] <= yanked_at + EVENTS_WAIT_S + 1, served.mandatory.lines


def _every_worker_upgrades(workers: list[Worker], published_at: float, key: str) -> None:
    upgraded = [w.after(published_at, compiled, 60) for w in workers]
    assert all(upgraded), [w.lines for w in workers]
    assert all(line["key"] == key and line["equal"] for line in upgraded)


def _publisher(fleet: Fleet, pt2_archive: Path, tmp_path: Path):
    """Publish archive A (the graph the workers export) as another mint would, under the fleet's declaration."""
    archive = tmp_path / "mint" / "model.pt2"
    archive.parent.mkdir()
    shutil.copy(pt2_archive, archive)
    shutil.copy(derived_constants_path(pt2_archive), derived_constants_path(archive))
    token = fleet.store.mint("another-mint", f"{fleet.repo}:read,write")

    def publish() -> str:
        with Client(fleet.store.base_url, token, cache_dir=tmp_path / "mint-cache") as client:
            return client.publish(
                fleet.repo,
                archive,
                family=fleet.family,
                envelope=ENVELOPE,
                toolchain=environment_toolchain(),
                sm=environment_sm("cpu"),
                code=code_fingerprint(tiny_model(0)),
            ).key

    return publish


# --- takeovers and a failing graph: two fleets at once on one store ---------------------------------


def child_pid(log: list[str]) -> int:
    return int(log[0].rsplit("(pid ", 1)[1].rstrip(")"))


def claim_of(log: list[str]) -> str:
    return log[0].split("compiling claim ", 1)[1].split(" ", 1)[0]


class Troubled:
    """Two fleets started together, so that their compiles, lapses and backoffs overlap.

    The takeover fleet (two workers) meets both kills in turn, each made by a thread as soon as the
    compile it targets has started (so each lands mid-compile): the first holder's mint child is
    SIGKILLed; its claim lapses and a worker takes over (compile 2); that holder worker itself is
    SIGKILLed; its orphaned child stops, the claim lapses and another worker takes over (compile 3),
    which publishes. Each kill costs exactly one more compile: two per takeover, three in all.
    """

    def __init__(self, store, tmp_path_factory, compile_memo: Path) -> None:
        self.takeover = Fleet(store, tmp_path_factory.mktemp("takeover"), compile_memo=compile_memo)
        # The mint refuses to compile under TORCHINDUCTOR_DEBUG_COMPILE (it changes the bytes outside its
        # policy): a compile error in seconds. The workers export and serve as usual.
        self.failing = Fleet(store, tmp_path_factory.mktemp("failing"), env={"TORCHINDUCTOR_DEBUG_COMPILE": "1"})
        self.takeover.start(2)
        self.failing.start(1)
        self.holder: Worker | None = None  # the worker killed, holding the second compile's claim
        self.child_killed = threading.Event()
        self._kills = threading.Thread(target=self._kill, daemon=True)
        self._kills.start()

    def _kill(self) -> None:
        first = self.takeover.wait_for_a_compile()
        time.sleep(1)  # inside the compile (importing torch, loading the program)
        os.kill(child_pid(first), signal.SIGKILL)
        self.child_killed.set()
        deadline = time.monotonic() + 180
        while len(self.takeover.mint_logs()) < 2:
            assert time.monotonic() < deadline, "no takeover after the child was killed"
            time.sleep(0.05)
        (second,) = [log for log in self.takeover.mint_logs() if claim_of(log) != claim_of(first)]
        holding = lambda line: reason(line) == f"minting here (claim {claim_of(second)})"  # noqa: E731
        while self.holder is None and time.monotonic() < deadline:
            self.holder = next((w for w in self.takeover.workers if w.first(holding)), None)
            time.sleep(0.02)
        self.holder.process.send_signal(signal.SIGKILL)

    def killed(self) -> None:
        self._kills.join(240)

    def close(self) -> None:
        self.failing.stop_file.touch()  # both fleets leave together
        for fleet in (self.takeover, self.failing):
            fleet.close()


@pytest.fixture(scope="module")
def troubled(request, tmp_path_factory, configuration, compile_memo):
    settings = {"claim_ttl_s": CLAIM_TTL_S, "claim_backoff_s": CLAIM_BACKOFF_S}
    with store_for_the_module(request, tmp_path_factory, configuration, **settings) as store:
        fleets = Troubled(store, tmp_path_factory, compile_memo)
        try:
            yield fleets
        finally:
            fleets.close()


def test_a_mint_child_killed_mid_compile_lapses_and_the_fleet_takes_over(troubled):
    fleet = troubled.takeover
    assert troubled.child_killed.wait(240), [w.lines for w in fleet.workers]
    troubled.killed()
    first, second = sorted(fleet.mint_logs(), key=lambda log: logged_at(log, "compiling claim"))[:2]
    assert logged_at(first, "published ") is None and logged_at(first, "the worker is gone") is None, first
    killed = "mint failed: the mint child ended with status -9"  # its worker says so while it waits
    assert any(w.first(lambda line: killed in reason(line)) for w in fleet.workers), [w.lines for w in fleet.workers]
    # A worker took the lapsed claim over: the second compile, under another claim.
    assert claim_of(second) != claim_of(first)
    assert any(w.first(lambda line: reason(line) == f"minting here (claim {claim_of(second)})") for w in fleet.workers)


def test_a_holder_worker_killed_lapses_its_claim_and_another_worker_takes_over(troubled):
    fleet = troubled.takeover
    troubled.killed()
    assert troubled.holder is not None, [w.lines for w in fleet.workers]
    others = [w for w in fleet.workers if w is not troubled.holder]
    served = [worker.first(compiled, MINT_BOUND_S) for worker in others]
    assert all(served), [w.lines for w in others]
    assert all(line["equal"] for line in served)
    logs = sorted(fleet.mint_logs(), key=lambda log: logged_at(log, "compiling claim"))
    orphan = logs[1]
    # The orphaned child saw its worker gone and stopped without releasing: the claim lapsed, one takeover
    # (the third compile, which published). Or it finished its compile and published before its next look
    # at the worker (a second at most): a whole mint, nothing to take over.
    if logged_at(orphan, "published ") is not None:
        assert len(logs) == 2
    else:
        assert logged_at(orphan, "the worker is gone") is not None, orphan
        assert len(logs) == 3 and logged_at(logs[2], "published ") is not None, logs
    assert len(fleet.records()) == 1


def test_a_graph_that_cannot_compile_fails_then_backs_off_then_is_failing_after_five(troubled):
    fleet = troubled.failing
    failing = first_of(fleet.workers, lambda line: "failing until an admin clears it" in reason(line), FAILING_BOUND_S)
    assert failing, [w.lines for w in fleet.workers]
    assert "TORCHINDUCTOR_DEBUG_COMPILE is set" in reason(failing)
    assert len(fleet.mint_logs()) == 5  # five grants, five failed compiles, then none
    lines = [line for w in fleet.workers for line in w.lines]
    # Between failures the store answered claims `backoff` (only this fleet's declaration ever fails: the
    # takeover fleet's claims lapse, which is taken over at once). A worker shows it in its reason only if one
    # of its calls falls inside a backoff, which a loaded machine's slow mint children can step over.
    assert _claim_answers(fleet.store, "backoff") >= 1
    assert all(not compiled(line) for line in lines) and fleet.records() == []
    # An admin clears it: listed failing with the compile's error, then no longer.
    listed = _failing_of(fleet)
    assert [(entry["failures"], "TORCHINDUCTOR_DEBUG_COMPILE is set" in entry["reason"]) for entry in listed] == [
        (5, True)
    ]
    cleared = _claims_cli(fleet.store, "clear", str(listed[0]["id"]))
    assert cleared.exit_code == 0, cleared.output
    assert _failing_of(fleet) == []


def _claim_answers(store, outcome: str) -> float:
    """``cgstore_claims_total{outcome=…}`` as the store exports it."""
    pattern = re.compile(rf'^cgstore_claims_total{{outcome="{outcome}"}} (\S+)$', re.M)
    found = pattern.search(store.scrape_metrics())
    return float(found.group(1)) if found else 0.0


def _claims_cli(store, *args: str):
    env = {"CGSTORE_DATABASE_URL": store.settings.resolved_database_url, "CGSTORE_HOME": str(store.settings.home)}
    return CliRunner().invoke(app, ["claims", *args], env=env)


def _failing_of(fleet: Fleet) -> list[dict]:
    listed = _claims_cli(fleet.store, "list", "--failing")
    assert listed.exit_code == 0, listed.output
    return [entry for entry in map(json.loads, listed.output.splitlines()) if entry["repo"] == fleet.repo]
