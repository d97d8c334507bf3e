"""A regional mirror against booting straight from the upstream, over modelled links, in one run.

    python bench/mirror.py                     # 128 MiB artifact + 2 x 64 MiB components, 8 workers
    python bench/mirror.py --scale 0.25 --reps 1   # a quick check

Starts the upstream as in production (PostgreSQL + Ceph's RADOS Gateway, a
separate ``cgstore serve``; ``redirect_downloads`` off, so every byte a reader
gets crosses the link in front of it) and a mirror (embedded: SQLite + a
directory, its own process, ``CGSTORE_UPSTREAM_URL`` pointing through the far
link, ``CGSTORE_MIRROR_PREHEAT=1``). Two shaping proxies (``netmodel.py``)
model the links:

- **far** (a worker or the mirror to the upstream, across providers): 50 MiB/s
  in all, 10 MiB/s per connection, 80 ms to first byte;
- **near** (a worker to its regional mirror): 400 MiB/s in all, 5 ms.

The record is real (``bench/client.py``'s: a model of two square weights,
minted once, the two weights its components, the archive padded with fresh
random bytes). Each phase, in this order:

1. ``direct``: a worker's cold boot (``Client.load``, empty cache: resolve,
   record, verified ranged downloads) straight from the upstream over the far
   link; best of ``--reps``.
2. ``upstream_bytes_ratio``: ``--workers`` (8) workers boot the same record at
   once through the cold mirror over the near link; bytes the upstream sent
   (its ``cgstore_bytes_out_total``, answers included) ÷ one set of the
   record's bytes (artifact + components). Target ≤ 1.05: the mirror pulls each
   blob once (single-flight) however many workers ask.
3. ``mirror_boot_vs_direct``: a worker's cold boot through the (now warm)
   mirror over the near link ÷ ``direct``; best of ``--reps`` each. The
   mirror's own pull crossed the far link once, in phase 2 (its time is
   printed: the first worker's boot through a cold mirror). Target ≤ 0.5.
4. ``preheat_lag_s``: a second record (fresh bytes) is published straight to
   the upstream; seconds from the publish's return until the mirror holds it
   (its ``cgstore_mirror_preheats_total{outcome="pulled"}`` moves), no worker
   asking. Target ≤ the modelled transfer time of its bytes over the far link
   (bytes / 50 MiB/s + 80 ms) + 2 s.
5. ``outage_served_fraction``: the far link is cut (its proxy stopped): each
   record the mirror holds is booted through it by a worker with an empty
   cache; the fraction that boot. Target 1.0. A key the mirror never held is
   asked too: it must miss, with ``detail.upstream = "unavailable"``, promptly.

Workers verify receipts against the upstream's keys (``trusted_jwks=`` its
``GET /v1/keys``, saved at setup), as a region's workers should.

Last line: ``{"workers", "upstream_bytes_ratio", "mirror_boot_vs_direct",
"outage_served_fraction", "preheat_lag_s"}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import netmodel
import torch
from _common import REPO_ROOT, MiB, emit_result, log, mint_token, production_stack

from cgstore_client import Client, Want
from cgstore_client.archive import graph_digest_from_program
from cgstore_client.environment import environment_sm
from cgstore_client.keys import ck1
from cgstore_client.mint import package_compiled_graph
from client import TwoWeights, fresh_components, padded_archive
from tests.support import services

OWNER = "bench"
REPO = f"{OWNER}/mirror"
FAMILY = "bench-mirror"
TOOLCHAIN = {"torch": torch.__version__}
METRICS_TOKEN = "bench-metrics-token"
FAR = netmodel.Shape(per_connection=10 * MiB, aggregate=50 * MiB, latency_s=0.080)
NEAR = netmodel.Shape(per_connection=None, aggregate=400 * MiB, latency_s=0.005)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="sizes x this (default 1: 128 + 2 x 64 MiB)")
    parser.add_argument("--workers", type=int, default=8, help="workers booting through the cold mirror (default 8)")
    parser.add_argument("--reps", type=int, default=2, help="cold boots per side for the boot ratio (default 2)")
    return parser.parse_args()


@dataclass
class Record:
    key: str
    envelope: dict
    archive: Path
    components: dict[str, Path]
    #: Artifact + components, in bytes (read when made: the files go with the scratch directory).
    size: int = 0


def make_record(minted: Path, graph: str, side: int, artifact_bytes: int, text_len: int, scratch: Path) -> Record:
    """Fresh bytes under a key of their own (the envelope's ``text_len`` tells the records apart)."""
    directory = scratch / f"record-{text_len}"
    directory.mkdir()
    envelope = {"shapes": [[64, 64]], "text_len": text_len}
    padded_archive(minted, directory / "artifact.pt2", artifact_bytes)
    key = ck1(graph, envelope, environment_sm(), TOOLCHAIN)
    components = fresh_components(side, directory)
    size = (directory / "artifact.pt2").stat().st_size + sum(path.stat().st_size for path in components.values())
    return Record(key, envelope, directory / "artifact.pt2", components, size)


def publish(url: str, token: str, record: Record, cache: Path) -> None:
    with Client(url, token, cache_dir=cache) as client:
        client.publish(
            REPO,
            record.archive,
            family=FAMILY,
            envelope=record.envelope,
            toolchain=TOOLCHAIN,
            sm=environment_sm(),
            components=record.components,
        )


def boot(url: str, token: str, key: str, jwks: Path, cache: Path) -> float:
    """A worker's cold boot of ``key``: resolve, record, verified downloads into an empty cache; its seconds."""
    shutil.rmtree(cache, ignore_errors=True)
    os.sync()
    started = time.perf_counter()
    with Client(url, token, cache_dir=cache, trusted_jwks=str(jwks)) as client:
        client.load(FAMILY, [Want(key, mandatory=True)])
    return time.perf_counter() - started


def metric(url: str, name: str, labels: str = "") -> float:
    """One series of a store's ``/metrics`` (summed over matching lines; 0 when absent)."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=30).text
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for series, value in pattern.findall(text) if labels in (series or ""))


@contextlib.contextmanager
def mirror_store(upstream_url: str, token_file: Path, home: Path) -> Iterator[services.StoreProcess]:
    """The mirror: embedded, its own process; migrated, the upstream's keys trusted, then served."""
    port = services.free_port()
    env = {
        **os.environ,
        "CGSTORE_HOME": str(home),
        "CGSTORE_HOST": "127.0.0.1",
        "CGSTORE_PORT": str(port),
        "CGSTORE_LOG_LEVEL": "warning",
        "CGSTORE_UPSTREAM_URL": upstream_url,
        "CGSTORE_UPSTREAM_TOKEN_FILE": str(token_file),
        "CGSTORE_MIRROR_PREHEAT": "1",
        "CGSTORE_MIRROR_FOLLOW_WAIT_S": "10",
        "CGSTORE_METRICS_TOKEN": METRICS_TOKEN,
    }
    cli = [sys.executable, "-m", "cgstore.cli"]
    subprocess.run([*cli, "db", "upgrade"], env=env, check=True, cwd=REPO_ROOT)
    subprocess.run([*cli, "mirror", "trust"], env=env, check=True, cwd=REPO_ROOT, capture_output=True)
    proc = subprocess.Popen([*cli, "serve"], env=env, cwd=REPO_ROOT)
    try:
        services.wait_for_port(port, proc=proc)
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while httpx.get(f"{base_url}/readyz").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("the mirror never became ready")
            time.sleep(0.1)
        yield services.StoreProcess(base_url=base_url, process=proc, env=env)
    finally:
        services.stop_process(proc)


def fleet_through_mirror(url: str, token: str, key: str, jwks: Path, scratch: Path, workers: int) -> list[float]:
    """``workers`` cold boots of ``key`` at once (threads, each its own client and cache); their seconds."""
    times: list[float | BaseException] = [0.0] * workers
    start = threading.Barrier(workers)

    def worker(n: int) -> None:
        try:
            start.wait()
            times[n] = boot(url, token, key, jwks, scratch / f"fleet-{n}")
        except BaseException as error:  # noqa: BLE001 - re-raised below, in the main thread
            times[n] = error

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in times:
        if isinstance(result, BaseException):
            raise result
    return times  # type: ignore[return-value]


def wait_for_preheat(mirror_url: str, before: float, timeout_s: float) -> float:
    """Seconds until the mirror's preheat counter moves past ``before``."""
    started = time.perf_counter()
    while metric(mirror_url, "cgstore_mirror_preheats_total", 'outcome="pulled"') <= before:
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"the mirror did not preheat within {timeout_s:.0f} s")
        time.sleep(0.05)
    return time.perf_counter() - started


def outage(mirror_url: str, token: str, held: list[str], jwks: Path, scratch: Path) -> float:
    """The upstream unreachable: the fraction of ``held`` that boots through the mirror; a stranger key checked."""
    served = 0
    for n, key in enumerate(held):
        try:
            seconds = boot(mirror_url, token, key, jwks, scratch / f"outage-{n}")
            served += 1
            log(f"  outage: {key[:16]}… booted through the mirror in {seconds:.2f}s")
        except Exception as error:  # counted: the figure is the fraction served
            log(f"  outage: {key[:16]}… NOT served: {type(error).__name__}: {error}")
    stranger = "ck1-" + "0" * 56
    started = time.perf_counter()
    answer = httpx.post(
        f"{mirror_url}/v1/compiled-graphs:resolve",
        json={"family": FAMILY, "keys": [stranger]},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    log(
        f"  outage: a key never held answers {answer.status_code} in {time.perf_counter() - started:.2f}s: "
        f"{answer.text[:300]}"
    )
    ready = httpx.get(f"{mirror_url}/readyz").status_code
    health = httpx.get(f"{mirror_url}/healthz")
    log(f"  outage: /readyz {ready}, /healthz {health.status_code} {health.text[:200]}")
    return served / len(held)


def main() -> None:
    args = parse_args()
    side = int((64 * args.scale * MiB // 4) ** 0.5)
    artifact_bytes = int(128 * args.scale * MiB)
    log(f"load average at start: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="cgstore-bench-mirror-") as scratch_dir:
        scratch = Path(scratch_dir)
        program = torch.export.export(TwoWeights(side), (torch.randn(1, side),))
        package_compiled_graph(program, scratch / "minted.pt2")
        graph = graph_digest_from_program(program)
        first = make_record(scratch / "minted.pt2", graph, side, artifact_bytes, 0, scratch)
        second = make_record(scratch / "minted.pt2", graph, side, artifact_bytes, 1, scratch)
        log(f"record: {first.size / MiB:.0f} MiB (artifact + 2 components); far link {FAR}, near link {NEAR}")

        with production_stack(redirect_downloads=False, metrics_token=METRICS_TOKEN) as upstream:
            publisher = upstream.mint("publisher", f"{OWNER}/*:read,write")
            reader = upstream.mint("direct-worker", f"{OWNER}/*:read")
            (scratch / "upstream-token").write_text(upstream.mint("mirror-eu", f"{OWNER}/*:read"))
            jwks = scratch / "upstream-jwks.json"
            jwks.write_text(json.dumps(httpx.get(f"{upstream.base_url}/v1/keys").json()))
            publish(upstream.base_url, publisher, first, scratch / "publish-cache")

            with (
                netmodel.shaped_proxy("127.0.0.1", int(upstream.base_url.rsplit(":", 1)[1]), FAR) as far,
                mirror_store(far.url(), scratch / "upstream-token", scratch / "mirror-home") as mirror,
                netmodel.shaped_proxy("127.0.0.1", int(mirror.base_url.rsplit(":", 1)[1]), NEAR) as near,
            ):
                worker = mint_token(mirror.env, "worker", f"{OWNER}/*:read")

                direct = [boot(far.url(), reader, first.key, jwks, scratch / "direct") for _ in range(args.reps)]
                log(f"direct over the far link: {', '.join(f'{t:.2f}s' for t in direct)}")

                sent_before = metric(upstream.base_url, "cgstore_bytes_out_total")
                fleet = fleet_through_mirror(near.url(), worker, first.key, jwks, scratch, args.workers)
                upstream_sent = metric(upstream.base_url, "cgstore_bytes_out_total") - sent_before
                log(
                    f"{args.workers} workers through the cold mirror: slowest {max(fleet):.2f}s, "
                    f"fastest {min(fleet):.2f}s; the upstream sent {upstream_sent / MiB:.1f} MiB "
                    f"for {first.size / MiB:.1f} MiB of record"
                )

                through = [boot(near.url(), worker, first.key, jwks, scratch / "near") for _ in range(args.reps)]
                log(f"through the warm mirror over the near link: {', '.join(f'{t:.2f}s' for t in through)}")

                before = metric(mirror.base_url, "cgstore_mirror_preheats_total", 'outcome="pulled"')
                publish(upstream.base_url, publisher, second, scratch / "publish-cache")
                modelled_s = second.size / FAR.aggregate + FAR.latency_s
                lag = wait_for_preheat(mirror.base_url, before, timeout_s=modelled_s + 120)
                log(f"preheat: on the mirror {lag:.2f}s after the publish (modelled transfer {modelled_s:.2f}s)")

                far.process.terminate()
                far.process.wait(10)
                served = outage(near.url(), worker, [first.key, second.key], jwks, scratch)
    log(f"load average at the end: {os.getloadavg()}")
    emit_result(
        {
            "workers": args.workers,
            "upstream_bytes_ratio": round(upstream_sent / first.size, 3),
            "mirror_boot_vs_direct": round(min(through) / min(direct), 3),
            "outage_served_fraction": round(served, 3),
            "preheat_lag_s": round(lag, 2),
        }
    )


if __name__ == "__main__":
    main()
