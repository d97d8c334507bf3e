"""Boot downloads over a modelled network: the client vs aria2c vs curl, same proxy, same bytes, one run.

    python bench/boot_network.py                             # 1 GiB + 2 x 256 MiB, C 32, A 256 MiB/s, L 20 ms
    python bench/boot_network.py --scale 0.25 --rounds 3     # a quick check
    python bench/boot_network.py --c 96 --a 512
    python bench/boot_network.py --unshaped-only --scale 0.5   # only the run straight against RGW

The store runs embedded (SQLite + the directory backend, ``cgstore serve`` in
its own process, so blob GETs are answered by the store itself) and holds one
1 GiB blob and two 256 MiB blobs of fresh random bytes in one repo (uploaded
straight to the store, not through the proxy). Every download goes through
one shaping proxy (``netmodel.py``: per-connection cap C, aggregate cap A,
first-byte latency L per request), started once for the whole run after its
unshaped forwarding rate was measured and logged (it must be >= 2·A, or the
proxy, not the model, would be what is measured).

Each round runs every side once into an empty directory, the order rotated
from round to round (so with 3 rounds each side runs once in each position);
every timed run starts after ``os.sync()``:

- client: ``cgstore_client.Client(proxy URL).fetch_blob`` of the three blobs,
  three threads (as ``load`` does), empty cache: each blob hashed while it
  streams, fsynced, renamed into the cache on a digest and size match;
- aria2c: one ``aria2c -x 16 -s 16 -k 16M`` of the three URLs (with the
  ``Authorization: Bearer`` header), then blake3 of the three files (aria2c does
  not fsync);
- curl: three ``curl`` processes at once, one stream each, then blake3 of the
  three files (no fsync);
- the limit: total bytes / A, computed.

Then the client's own ceiling, with no model in the way (``--unshaped-rounds``,
default 5): the same sizes of fresh bytes published to a production store (PostgreSQL +
Ceph's RADOS Gateway, ``redirect_downloads`` on), each round (order alternating):

- client: ``Client(store URL).fetch_blob`` of the three blobs, three threads,
  empty cache: the store answers 307, the parts go straight to RGW's presigned
  URL, every byte is hashed, the file fsynced and renamed on a match;
- aria2c: the same ``aria2c -x 16`` on the three presigned URLs (asked of the
  store just before the round), then blake3 of the three files (no fsync).

Throughputs are total MiB / wall seconds, best of the rounds (medians are
printed). Last line: ``{"vs_limit", "vs_aria2c", "vs_single_stream",
"client_mib_s", "aria2c_mib_s", "curl_mib_s", "vs_aria2c_unshaped",
"client_unshaped_mib_s", "aria2c_unshaped_mib_s"}``; ``vs_limit`` = client / A,
``vs_aria2c`` = client / aria2c, ``vs_single_stream`` = client / curl,
``vs_aria2c_unshaped`` = client / aria2c straight against RGW.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import netmodel
from _common import (
    MiB,
    blake3_file,
    embedded_stack,
    emit_result,
    log,
    median,
    production_stack,
    timed,
    write_random_file,
)

from cgstore_client import Client

REPO = "bench/boot"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="blob sizes x this (default 1: 1 GiB + 2 x 256 MiB)")
    parser.add_argument("--c", type=float, default=32, help="per-connection cap C, MiB/s (default 32)")
    parser.add_argument("--a", type=float, default=256, help="aggregate cap A, MiB/s (default 256)")
    parser.add_argument("--latency-ms", type=float, default=20, help="first-byte latency L per request (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each side once per round (default 3)")
    parser.add_argument(
        "--unshaped-rounds", type=int, default=5, help="rounds straight against RGW, best of them (default 5)"
    )
    parser.add_argument(
        "--unshaped-only", action="store_true", help="skip the modelled network (the last line has the unshaped fields)"
    )
    return parser.parse_args()


def run_client(url: str, token: str, blobs: list[tuple[str, int]], out: Path) -> None:
    with Client(url, token, cache_dir=out) as client, ThreadPoolExecutor(len(blobs)) as pool:
        for future in [pool.submit(client.fetch_blob, REPO, digest, size) for digest, size in blobs]:
            future.result()


def check_files(blobs: list[tuple[str, int]], out: Path) -> None:
    for digest, size in blobs:
        path = out / digest[7:]
        if path.stat().st_size != size or blake3_file(path) != digest:
            raise AssertionError(f"{path} is not {digest} ({size} bytes)")


def run_aria2c(url: str, token: str, blobs: list[tuple[str, int]], out: Path) -> None:
    aria2c([blob_url(url, digest) for digest, _ in blobs], [f"--header=Authorization: Bearer {token}"], blobs, out)


def aria2c(urls: list[str], options: list[str], blobs: list[tuple[str, int]], out: Path) -> None:
    """One ``aria2c -x 16 -s 16 -k 16M`` of ``urls`` (blob i into ``out``/its hex), then their blake3 checked."""
    listing = out / "urls.txt"
    out.mkdir()
    listing.write_text("".join(f"{url}\n  out={digest[7:]}\n" for url, (digest, _) in zip(urls, blobs, strict=True)))
    subprocess.run(
        [
            "aria2c",
            "-x",
            "16",
            "-s",
            "16",
            "-k",
            "16M",
            "-j",
            str(len(blobs)),
            *options,
            "-d",
            str(out),
            "-i",
            str(listing),
            "--file-allocation=none",
            "--console-log-level=warn",
            "--summary-interval=0",
            "--download-result=hide",
            "--allow-overwrite=true",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    check_files(blobs, out)


def run_curl(url: str, token: str, blobs: list[tuple[str, int]], out: Path) -> None:
    out.mkdir()
    procs = [
        subprocess.Popen(
            ["curl", "-sSf", "-H", f"Authorization: Bearer {token}", "-o", str(out / digest[7:]), blob_url(url, digest)]
        )
        for digest, _ in blobs
    ]
    for proc in procs:
        if proc.wait():
            raise RuntimeError(f"curl exited with {proc.returncode}")
    check_files(blobs, out)


def own_and_children_cpu() -> float:
    """CPU seconds of this process (the client, blake3) and of its finished children (aria2c, curl)."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def blob_url(url: str, digest: str) -> str:
    return f"{url}/v1/repos/{REPO}/blobs/{digest}"


def upload(url: str, token: str, sizes: list[int], scratch: Path) -> list[tuple[str, int]]:
    """Fresh random bytes of each size published to ``url``'s store as blobs of ``REPO``: (digest, size) each."""
    blobs = []
    with Client(url, token, cache_dir=scratch / "upload-cache") as client:
        for i, size in enumerate(sizes):
            path = scratch / f"blob-{i}"
            write_random_file(path, size)
            blobs.append((client.upload_blob(REPO, path), size))
            path.unlink()
    shutil.rmtree(scratch / "upload-cache")
    return blobs


def run_rounds(sides: dict, rounds: int, scratch: Path, total: int, watch: dict[str, int]) -> dict[str, float]:
    """Every side once per round into an empty directory (order rotated), after ``os.sync()``; best MiB/s each."""
    results: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for round_ in range(rounds):
        for name in order[round_ % len(order) :] + order[: round_ % len(order)]:
            out = scratch / name
            os.sync()
            downloader = own_and_children_cpu()
            with timed(watch) as timing:
                sides[name](out)
            timing.cpu_s["downloader"] = own_and_children_cpu() - downloader
            results[name].append(total / MiB / timing.wall_s)
            cpu = ", ".join(f"{who} {seconds / timing.wall_s:.0%}" for who, seconds in timing.cpu_s.items())
            log(f"round {round_} {name}: {timing.wall_s:.2f}s, {results[name][-1]:.1f} MiB/s (CPU of a core: {cpu})")
            shutil.rmtree(out)
    for name, values in results.items():
        log(f"{name}: best {max(values):.1f} MiB/s, median {median(values):.1f} MiB/s")
    return {name: max(values) for name, values in results.items()}


def shaped(args: argparse.Namespace, sizes: list[int]) -> dict[str, float]:
    """The client, aria2c and curl through the network model, against the embedded store."""
    total = sum(sizes)
    shape = netmodel.Shape(per_connection=args.c * MiB, aggregate=args.a * MiB, latency_s=args.latency_ms / 1000)
    capacity = netmodel.forwarding_capacity() / MiB
    log(
        f"proxy forwards {capacity:.0f} MiB/s unshaped (3 streams, 1 GiB): "
        + ("at least" if capacity >= 2 * args.a else "BELOW")
        + f" 2·A = {2 * args.a:.0f} MiB/s"
    )
    with tempfile.TemporaryDirectory(prefix="cgstore-bench-net-") as scratch_dir, embedded_stack() as stack:
        scratch = Path(scratch_dir)
        token = stack.mint("bench", f"{REPO.split('/')[0]}/*:read,write")
        blobs = upload(stack.base_url, token, sizes, scratch)
        log(f"uploaded {total / MiB:.0f} MiB as three blobs of {REPO}")
        host, port = stack.base_url.removeprefix("http://").split(":")
        with netmodel.shaped_proxy(host, int(port), shape) as proxy:
            sides = {
                name: (lambda out, run=run: run(proxy.url(), token, blobs, out))
                for name, run in (("client", run_client), ("aria2c", run_aria2c), ("curl", run_curl))
            }
            best = run_rounds(
                sides, args.rounds, scratch, total, {"proxy": proxy.process.pid, "store": stack.server_pid}
            )
    log(f"limit: total / A = {total / MiB / args.a:.2f}s ({args.a:.0f} MiB/s)")
    return best


def presigned(url: str, token: str, digest: str) -> str:
    """Where the store redirects a GET of blob ``digest``: RGW's presigned URL."""
    answer = httpx.get(blob_url(url, digest), headers={"Authorization": f"Bearer {token}"}, follow_redirects=False)
    if answer.status_code != 307:
        raise SystemExit(f"expected a 307 to a presigned URL, got {answer.status_code}")
    return answer.headers["location"]


def unshaped(args: argparse.Namespace, sizes: list[int]) -> dict[str, float]:
    """The client against aria2c straight on RGW's presigned URLs: the client's own ceiling."""
    total = sum(sizes)
    with (
        tempfile.TemporaryDirectory(prefix="cgstore-bench-rgw-") as scratch_dir,
        production_stack(redirect_downloads=True, reaper_interval_s=3600) as stack,
    ):
        scratch = Path(scratch_dir)
        token = stack.mint("bench", f"{REPO.split('/')[0]}/*:read,write")
        blobs = upload(stack.base_url, token, sizes, scratch)
        log(f"uploaded {total / MiB:.0f} MiB as three blobs of {REPO} to RGW (unshaped: no model in the way)")

        def aria2c_presigned(out: Path) -> None:
            aria2c([presigned(stack.base_url, token, digest) for digest, _ in blobs], [], blobs, out)

        sides = {"client": lambda out: run_client(stack.base_url, token, blobs, out), "aria2c": aria2c_presigned}
        return run_rounds(sides, args.unshaped_rounds, scratch, total, {"store": stack.server_pid, **stack.s3_pids})


def main() -> None:
    args = parse_args()
    sizes = [int(1024 * MiB * args.scale), int(256 * MiB * args.scale), int(256 * MiB * args.scale)]
    log(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; blobs {[s // MiB for s in sizes]} MiB; "
        f"C {args.c} MiB/s, A {args.a} MiB/s, L {args.latency_ms} ms"
    )
    result = {}
    if not args.unshaped_only:
        best = shaped(args, sizes)
        result = {
            "vs_limit": round(best["client"] / args.a, 3),
            "vs_aria2c": round(best["client"] / best["aria2c"], 3),
            "vs_single_stream": round(best["client"] / best["curl"], 3),
            "client_mib_s": round(best["client"], 1),
            "aria2c_mib_s": round(best["aria2c"], 1),
            "curl_mib_s": round(best["curl"], 1),
        }
    best = unshaped(args, sizes)
    log(f"load average {os.getloadavg()[0]:.1f} after the runs")
    emit_result(
        {
            **result,
            "vs_aria2c_unshaped": round(best["client"] / best["aria2c"], 3),
            "client_unshaped_mib_s": round(best["client"], 1),
            "aria2c_unshaped_mib_s": round(best["aria2c"], 1),
        }
    )


if __name__ == "__main__":
    main()
