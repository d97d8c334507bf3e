"""Misses, once per fleet: claim the mint, compile in a child, switch to compiled in place, follow yanks.

``client.boot(..., mint="on_miss", publish_to="OWNER/REPO")`` on a miss claims
the declaration in ``publish_to`` (:mod:`cgstore_client.worker.claims`). One
worker of the fleet is granted it: it exports its live model (the graph it
runs, so the record is its own) to a private file and starts a mint child
(:mod:`cgstore_client.worker.mint_child`, ``python -m``: a fresh interpreter,
never a fork of a process holding a model and threads) that compiles,
publishes and beats the claim, while the worker serves eager. Every other
worker hears the mint is held and waits.

Each handle has a :class:`Follower`; every follower of a ``Client`` is fed by
one :class:`Watcher`, a daemon thread holding one long-poll of the record
events feed (``GET /v1/compiled-graphs:events``) for the whole process. A
``published`` event for a handle's declaration (its discovery digest, binding
signature and release) wakes its follower, which serves the declaration again
(discover, the structural gate, verified download, bind, confirmation; a
record of the graph the worker exported itself is confirmed as it is) and
switches the handle to compiled in place. A ``yanked`` event for the key a
handle serves switches it to eager (``yanked: <reason>``) and the follower
waits for a publish again; it does not claim, since minting the same model
again would compile the graph that was withdrawn.

Without the feed (a store older than it, or unreachable) the watcher backs off
with jitter and followers look again every :data:`POLL_WITHOUT_FEED_S`; nothing
here ever raises into serving. The token goes only to the store's origin (the
transport refuses any other).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cgstore_client.errors import CgstoreError, CompiledRequired, ConfigError, NotFound, StoreError, Unavailable
from cgstore_client.wire.fleet import MAX_EVENTS_WAIT_S, EventsAnswer, RecordEvent
from cgstore_client.worker import claims, discovery, outcomes
from cgstore_client.worker.discovery import Booted, Declared
from cgstore_client.worker.http import Transport, parse_answer, split_repo

if TYPE_CHECKING:  # pragma: no cover - typing only
    from cgstore_client.wire.fleet import ClaimAnswer, ClaimGranted

log = logging.getLogger(__name__)

#: ``mint=``: never mint (wait for someone else's publish), or claim and mint on a miss.
MINT_MODES = ("never", "on_miss")
#: Without the events feed, how often a waiting handle looks again (discover or claim).
POLL_WITHOUT_FEED_S = 10.0
#: A failing declaration is asked about again this often (an admin may have cleared it).
FAILING_RECHECK_S = 300.0
#: After a held claim's expiry, this much more before claiming it (the holder's last beat may be in flight).
HELD_SLACK_S = 0.5
#: The store unreachable: claims and the feed back off from this, doubling, with full jitter, up to the cap.
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.5, 30.0
#: How long a new handle waits for the watcher's first cursor (so no publish falls between its boot and the feed).
FIRST_CURSOR_WAIT_S = 5.0
#: Seconds the API call deadline must exceed a long-poll's ``wait`` by.
POLL_MARGIN_S = 5.0
#: How long ``Client.close()`` waits for the watcher's thread to end (its long-poll is cut at once).
STOP_JOIN_S = 1.0
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def jittered(failures: int) -> float:
    """Full-jitter exponential backoff: a fleet that lost its store does not come back in step."""
    return random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, failures - 1)))


def _at(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds_until(moment: dt.datetime) -> float:
    return max(0.0, (moment - dt.datetime.now(dt.UTC)).total_seconds())


# --- the events feed ---------------------------------------------------------------------------


class Watcher:
    """One long-poll of the events feed per ``Client``, shared by its handles' followers (a daemon thread).

    ``live`` is set while the feed answers; followers poll on their own while it is not.
    """

    def __init__(self, client: Any, wait_s: float = MAX_EVENTS_WAIT_S) -> None:
        self._client = client
        self._wait_s = max(1.0, min(float(wait_s), MAX_EVENTS_WAIT_S))
        self._followers: weakref.WeakSet[Follower] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.live = threading.Event()
        self._tried = threading.Event()  # the first ask for a cursor has been answered, either way
        self._thread: threading.Thread | None = None
        self._transport: Transport | None = None
        self._family: str | None = None
        self._reset = False

    def add(self, follower: Follower) -> None:
        """Follow ``follower``'s handle; returns once the feed has a cursor (or could not get one soon)."""
        with self._lock:
            families = {f.declared.family for f in self._followers} | {follower.declared.family}
            self._followers.add(follower)
            if self._family is not None and families != {self._family}:
                self._reset = True  # a second family: follow the whole feed from now on (one connection)
            if self._thread is None and not self._stop.is_set():
                self._family = follower.declared.family
                # Its own connection: closing it cuts the long-poll in flight, whatever else the client sends.
                client = self._client
                self._transport = Transport(client.url, client.token, retry=client.retry, limits=client.limits)
                self._thread = threading.Thread(target=self._run, name="cgstore-events", daemon=True)
                self._thread.start()
        self._tried.wait(FIRST_CURSOR_WAIT_S)  # a store without the feed costs one refused request, not the wait

    def stop(self, join_s: float = STOP_JOIN_S) -> None:
        """End the feed now: the long-poll in flight is cut (its own connection closed), followers waiting
        on it stop, and the thread is joined for up to ``join_s`` seconds. Nothing is sent after this."""
        self._stop.set()
        self.live.clear()
        self._tried.set()  # a handle booting now does not wait for a cursor that will never come
        with self._lock:
            transport, thread = self._transport, self._thread
            followers = list(self._followers)
        if transport is not None:
            transport.close()
        for follower in followers:
            follower.stop()
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_s)

    def _poll(self, since: str, wait: float) -> EventsAnswer:
        params: dict[str, Any] = {"since": since, "wait": int(wait)}
        if self._family is not None:
            params["family"] = self._family
        response = self._transport.request("GET", "/v1/compiled-graphs:events", params=params, retry=False)
        return parse_answer(EventsAnswer, response.content)

    def _run(self) -> None:
        cursor: str | None = None
        failures = 0
        lost = False  # a cursor was given up: events may have been missed
        wait = min(self._wait_s, max(1.0, self._client.limits.call_deadline_s - POLL_MARGIN_S))
        while not self._stop.is_set():
            try:
                if self._reset:
                    with self._lock:
                        self._reset, self._family, cursor, lost = False, None, None, True
                if cursor is None:
                    cursor = self._poll("now", 0).next
                    self.live.set()
                    self._tried.set()
                    failures = 0
                    if lost:
                        lost = False
                        self._resync()  # anything may have happened while there was no cursor
                    continue
                answer = self._poll(cursor, wait)
            except Exception as err:  # never into serving: the store down, a refused cursor, a closed client
                self._tried.set()
                if self._stop.is_set():
                    return
                self.live.clear()
                failures += 1
                if isinstance(err, StoreError) and not isinstance(err, Unavailable):
                    # An expired or refused cursor (or no feed at all): start again from the head.
                    lost, cursor = lost or cursor is not None, None
                pause = jittered(failures) if not isinstance(err, NotFound) else BACKOFF_CAP_S
                log.info("cgstore: the events feed is unavailable (%s); again in %.1f s", err, pause)
                self._stop.wait(pause)
                continue
            failures = 0
            cursor = answer.next
            for event in answer.events:
                self._dispatch(event)

    def _followers_now(self) -> list[Follower]:
        with self._lock:
            return list(self._followers)

    def _dispatch(self, event: RecordEvent) -> None:
        for follower in self._followers_now():
            try:
                follower.on_event(event)
            except Exception:  # one handle's trouble never stops the feed
                log.exception("cgstore: handling %s of %s", event.kind, event.key)

    def _resync(self) -> None:
        for follower in self._followers_now():
            with contextlib.suppress(Exception):
                follower.resync()


# --- one handle ------------------------------------------------------------------------------


class Follower:
    """Moves one handle through the miss path (claim, mint, wait, upgrade) and reacts to its events."""

    def __init__(
        self, client: Any, booted: Booted, repo: str | None, dynamic_shapes: Any, carried: discovery.Carried
    ) -> None:
        self._client = client
        self._booted = weakref.ref(booted)  # a dropped handle stops being followed
        self.declared: Declared = booted.declared
        self.repo = repo  # where to claim and publish; None: never mint
        self.claiming = repo is not None
        self.retry_after: float | None = None
        self._dynamic_shapes = dynamic_shapes
        self._poke = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._child: subprocess.Popen | None = None
        #: Set by the child's reaper: (published, why not) once the mint child has exited.
        self._outcome: tuple[bool, str | None] | None = None
        #: How this worker's last mint ended, while the fleet goes on without it (kept in the reasons that follow).
        self._failed_here: str | None = None
        self._failures = 0
        #: What the last serve of the declaration left for the next (the graph bound, each step's seconds).
        self._carried = carried
        #: When the feed last told of a publish for the declaration (``perf_counter``), for the upgrade's log line.
        self._heard: float | None = None

    # events (the watcher's thread) -------------------------------------------------------------

    def matches(self, event: RecordEvent) -> bool:
        request = self.declared.request
        return (
            event.family == self.declared.family
            and event.discovery_digest == self.declared.discovery_digest
            and event.binding_signature == request.binding_signature
            and (request.release is None or event.release == request.release)
        )

    def on_event(self, event: RecordEvent) -> None:
        booted = self._booted()
        if booted is None:
            return
        if event.kind == "yanked":
            loaded = booted.loaded
            if booted.compiled and loaded is not None and (loaded.key, loaded.repo) == (event.key, event.repo):
                self._yanked(booted, event.reason or "no reason given")
        elif event.kind == "published" and not booted.compiled and self.matches(event):
            self._heard = time.perf_counter()
            self.wake()

    def _yanked(self, booted: Booted, reason: str) -> None:
        booted.switch_to_eager(f"yanked: {reason}")
        log.warning("cgstore: %s in %s was yanked (%s): serving eager", booted.loaded.key, booted.loaded.repo, reason)
        self.claiming = False  # the graph withdrawn is what this model would compile again: wait for a publish
        self.start()

    def resync(self) -> None:
        """The feed restarted from its head: events may have been missed. A compiled handle checks its record is
        still live (a miss is a yank it did not hear of); an eager one looks again."""
        booted = self._booted()
        if booted is None:
            return
        if not booted.compiled:
            self.wake()
            return
        loaded = booted.loaded
        (answer,) = self._client.resolve(self.declared.family, [loaded.key])
        if answer.get("status") != "hit":
            self._yanked(booted, "the record is no longer live (seen when the events feed resumed)")

    def wake(self) -> None:
        self._poke.set()
        self.start()

    def stop(self) -> None:
        """The client closed: a thread waiting to move the handle looks once more and ends."""
        self._poke.set()

    # the follower's own thread ------------------------------------------------------------------

    def start(self, first_wait: float | None = 0.0) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._poke.set()
                return
            self._thread = threading.Thread(target=self._run, args=(first_wait,), name="cgstore-follow", daemon=True)
            self._thread.start()

    def _run(self, wait: float | None) -> None:
        watcher = self._client.watcher
        while True:
            if not watcher.live.is_set():
                wait = POLL_WITHOUT_FEED_S if wait is None else min(wait, POLL_WITHOUT_FEED_S)
            self._poke.wait(wait)
            self._poke.clear()
            booted = self._booted()
            if booted is None or self._client.closed or booted.compiled:
                return
            try:
                wait = self.step(booted)
            except Exception as err:  # never into serving
                log.warning("cgstore: following %s: %s", self.declared.family, err)
                self._failures += 1
                wait = jittered(self._failures)
            if booted.compiled:
                return

    def step(self, booted: Booted) -> float | None:
        """One move; the seconds to wait before the next (None: until woken)."""
        if self._child is not None:
            outcome = self._outcome
            if outcome is None:  # still minting; woken by a publish (maybe ours, before the child has exited)
                self._upgrade(booted)
                return None
            self._child = self._outcome = None
            published, why = outcome
            if published and self._upgrade(booted):
                return None
            if published:  # claiming again would compile the same graph into the same key, forever
                self.claiming = False
                booted.reason = why
                return None
            if why is not None:
                booted.reason = self._failed_here = (
                    why  # then claim again: backoff after a failure, takeover after a crash
                )
        if not self.claiming:
            self._upgrade(booted)
            return None
        if self._heard is not None and self._upgrade(booted):  # a publish for it was heard: no claim to ask first
            return None
        return self.claim_step(booted)

    def _upgrade(self, booted: Booted) -> bool:
        """Serve the declaration again; switch the handle in place when it comes back compiled."""
        known = booted.declared.graph if booted.declared is not None else None
        if known is not None and known != self.declared.graph:  # a confirmation measured it since
            self.declared = replace(self.declared, graph=known)
        started = time.perf_counter()
        fresh = discovery.serve_declared(self._client, self.declared, self._carried)
        if not fresh.compiled:
            self._heard = None
            return False
        booted.adopt(fresh)
        booted.declared = self.declared
        discovery.confirm_in_background(self._client, booted)
        switched = time.perf_counter()
        heard, self._heard = self._heard, None
        phases = {"woken": started - heard} if heard is not None else {}
        phases.update(self._carried.phases)
        phases["switch"] = switched - started - sum(self._carried.phases.values())
        steps = ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases.items())
        log.info(
            "cgstore: %s now serves %s from %s compiled (%.2f s%s: %s; confirmation %s)",
            self.declared.family,
            fresh.loaded.key,
            fresh.loaded.repo,
            switched - (heard if heard is not None else started),
            " since the publish was heard" if heard is not None else "",
            steps or "nothing to do",
            booted.confirmation,
        )
        return True

    # claims -------------------------------------------------------------------------------

    def claim_step(self, booted: Booted) -> float | None:
        """Claim the declaration and act on the answer; the seconds until it is worth asking again."""
        try:
            answer = claims.claim(self._client.writer, self.repo, self.declared.request)
        except Unavailable as err:
            self._failures += 1
            pause = jittered(self._failures)
            booted.reason = f"{outcomes.UNAVAILABLE}: {err} (claiming again in {pause:.0f} s)"
            self.retry_after = pause
            return pause
        except StoreError as err:  # no claim route, or not allowed to claim here: only wait for a publish
            self.claiming = False
            booted.reason = f"{outcomes.MISS}: the mint cannot be claimed in {self.repo} ({err})"
            return None
        self._failures = 0
        return self._on_answer(booted, answer)

    def _on_answer(self, booted: Booted, answer: ClaimAnswer) -> float | None:
        if answer.state == "granted":
            self.retry_after = _seconds_until(answer.expires_at)
            self._failed_here = None
            self._mint(booted, answer)
            return None
        if answer.state == "held":
            wait = _seconds_until(answer.expires_at) + HELD_SLACK_S
            here = f"; {self._failed_here}" if self._failed_here else ""
            booted.reason = f"waiting for a mint (claim {answer.claim}, expires {_at(answer.expires_at)}{here})"
            self.retry_after = wait
            return wait
        if answer.state == "published":
            self.retry_after = None
            if not self._upgrade(booted):
                fresh = discovery.serve_declared(self._client, self.declared)
                booted.reason = fresh.reason
                self.claiming = False  # a record exists but cannot be served here: minting would not change that
            return None
        if answer.state == "backoff":
            wait = _seconds_until(answer.retry_at)
            last = f" (mint failed: {answer.reason})" if answer.reason else ""
            booted.reason = f"backoff until {_at(answer.retry_at)} after {answer.failures} failed mints{last}"
            self.retry_after = wait
            return wait
        booted.reason = (
            f"mint failed: {answer.reason or 'no reason recorded'} ({answer.failures} in a row since "
            f"{_at(answer.since)}; failing until an admin clears it)"
        )
        self.retry_after = FAILING_RECHECK_S
        return FAILING_RECHECK_S

    # the mint ---------------------------------------------------------------------------

    def _mint(self, booted: Booted, granted: ClaimGranted) -> None:
        """Export the live model, start the mint child; on an export failure release the claim ``failed``."""
        work = self._client.cache.root / "mints" / _SAFE_NAME.sub("_", granted.claim)
        try:
            work.mkdir(mode=0o700, parents=True, exist_ok=False)
            # The claim is beaten from the grant on: an export can outlast a short TTL before the child beats.
            with claims.beating(self._client.writer, self.repo, granted.claim, granted.heartbeat_s):
                graph = export_program(self.declared, self._dynamic_shapes, work / "program.pt2")
            claims.heartbeat(self._client.writer, self.repo, granted.claim)  # a fresh TTL for the child's start
        except Exception as err:
            reason = claims.first_line(f"the live model did not export: {type(err).__name__}: {err}")
            booted.reason = f"mint failed: {reason}"
            with contextlib.suppress(CgstoreError):
                claims.release_failed(self._client.writer, self.repo, granted.claim, reason)
            shutil.rmtree(work, ignore_errors=True)
            return
        self.declared = replace(self.declared, graph=graph)
        booted.declared = self.declared
        job = self._write_job(work, granted)
        self._outcome = None
        self._child = child = _spawn(self._client, job, work.with_suffix(".log"))
        booted.reason = f"minting here (claim {granted.claim})"
        log.info("cgstore: minting %s here (claim %s, child %d)", self.declared.family, granted.claim, child.pid)
        threading.Thread(target=self._reap, args=(child, job), name="cgstore-mint-wait", daemon=True).start()

    def _reap(self, child: subprocess.Popen, job: dict[str, Any]) -> None:
        # The worker beats its child's claim too, for as long as the child lives: a child starting slowly on a
        # loaded machine must not lose the claim before its own first beat, and a dead child stops the beats.
        with claims.beating(self._client.writer, job["repo"], job["claim"], job["heartbeat_s"]):
            child.wait()
        self._outcome = _outcome(child, job)
        self.wake()

    def _write_job(self, work: Path, granted: ClaimGranted) -> dict[str, Any]:
        request = self.declared.request
        job = {
            "url": self._client.url,
            "write_url": self._client.write_url,
            "repo": self.repo,
            "claim": granted.claim,
            "heartbeat_s": granted.heartbeat_s,
            "family": self.declared.family,
            "envelope": request.envelope,
            "sm": request.sm,
            "toolchain": {**request.toolchain.components, **request.toolchain.recorded},
            "release": request.release,
            "code": request.code,
            "program": str(work / "program.pt2"),
            "work": str(work),
            "result": str(work / "result.json"),
            "cache_dir": str(self._client.cache.root),
            "parent": os.getpid(),
            "imports": model_modules(self.declared.model),
        }
        (work / "job.json").write_text(json.dumps(job), encoding="utf-8")
        return job


def _outcome(child: subprocess.Popen, job: dict[str, Any]) -> tuple[bool, str | None]:
    """The mint child's outcome: (published, why not); its work directory (program, archive) goes, its log stays."""
    result: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        result = json.loads(Path(job["result"]).read_text(encoding="utf-8"))
    shutil.rmtree(job["work"], ignore_errors=True)
    if child.returncode == 0 and "key" in result:
        return True, (
            f"{outcomes.MISS}: this worker's mint published {result['key']}, which is not served for this "
            "declaration (the key already recorded under another family in this repo?); not minting again"
        )
    if "error" in result:
        return False, f"mint failed: {result['error']}"
    # Killed (or its worker's device lost): nothing released, the claim lapses and the fleet takes over.
    return False, f"mint failed: the mint child ended with status {child.returncode} (claim {job['claim']} lapses)"


def model_modules(model: Any) -> list[str]:
    """The modules defining the model's classes: the child imports them before loading the program, since
    loading needs the pytree types they register (transformers' ``ModelOutput`` subclasses, say)."""
    modules = getattr(model, "modules", None)
    classes = {type(m) for m in modules()} if callable(modules) else {type(model)}
    return sorted({c.__module__ for c in classes} - {"__main__", "builtins"})


def export_program(declared: Declared, dynamic_shapes: Any, path: Path) -> str:
    """``torch.export`` the live model on the example inputs into ``path``; returns its graph digest (as the
    archive will hold it: :func:`discovery.serialized_graph_digest`)."""
    import torch

    with discovery.model_lock(declared.model):  # eager calls of the model wait: the export fakes its tensors
        program = torch.export.export(declared.model, tuple(declared.example_inputs), dynamic_shapes=dynamic_shapes)
    torch.export.save(program, str(path))
    return discovery.serialized_graph_digest(program)


def _spawn(client: Any, job: dict[str, Any], log_path: Path) -> subprocess.Popen:
    """``python -m cgstore_client.worker.mint_child`` with the token in its environment, its output in ``log_path``."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # where cgstore_client is importable from
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    for variable, token in (("CGSTORE_TOKEN", client.token), ("CGSTORE_WRITE_TOKEN", client.write_token)):
        env.pop(f"{variable}_FILE", None)
        env.pop(variable, None)
        if token:
            env[variable] = token
    job_path = Path(job["work"]) / "job.json"
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "cgstore_client.worker.mint_child", str(job_path)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            close_fds=True,
        )


# --- boot --------------------------------------------------------------------------------------


def boot(
    client: Any,
    family: str,
    model: Any,
    *,
    mint: str = "never",
    publish_to: str | None = None,
    dynamic_shapes: Any = None,
    watch: bool = True,
    mandatory: bool = False,
    example_inputs: tuple[Any, ...] | None = None,
    **declaration: Any,
) -> Booted:
    """Boot by declaration, then follow the handle: claim and mint on a miss (``mint="on_miss"``), upgrade
    when a record is published for it, go eager on a yank (``watch``). See the module docstring."""
    if mint not in MINT_MODES:
        raise ConfigError(f"mint is one of {MINT_MODES}, not {mint!r}")
    if mint == "on_miss":
        if example_inputs is None:
            raise ConfigError("mint='on_miss' exports the live model to mint it: pass example_inputs")
        if not publish_to:
            raise ConfigError("mint='on_miss' publishes what it mints: pass publish_to='OWNER/REPO'")
        split_repo(publish_to)
    declared = discovery.declare(family, model, mandatory=mandatory, example_inputs=example_inputs, **declaration)
    carried = discovery.Carried()
    booted = discovery.serve_declared(client, declared, carried)
    discovery.confirm_in_background(client, booted)
    if not watch or client.offline:
        if mandatory and not booted.compiled:
            raise CompiledRequired({family: booted.reason or outcomes.MISS})
        return booted
    follower = Follower(client, booted, publish_to if mint == "on_miss" else None, dynamic_shapes, carried)
    booted.follower = follower  # the handle keeps its follower alive, not the other way round
    client.watcher.add(follower)
    if booted.compiled:
        return booted
    # The first move before returning: the handle says at once whether it mints, waits or backs off,
    # and a mandatory boot raises with when to come back.
    wait = follower.claim_step(booted) if follower.claiming else None
    if mandatory:
        raise CompiledRequired({family: booted.reason or outcomes.MISS}, retry_after=follower.retry_after)
    if not booted.compiled:
        follower.start(wait)
    return booted
