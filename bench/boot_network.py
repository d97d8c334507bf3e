"""Boot downloads over a modelled network: the client vs aria2c vs curl, same proxy, same bytes, one run.

    python bench/boot_network.py                             # 1 GiB + 2 x 256 MiB, C 32, A 256 MiB/s, L 20 ms
    python bench/boot_network.py --scale 0.25 --rounds 3     # a quick check
    python bench/boot_network.py --c 96 --a 512

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

Throughputs are total MiB / wall seconds, best of the rounds (medians are
printed). Last line: ``{"vs_limit", "vs_aria2c", "vs_single_stream",
"client_mib_s", "aria2c_mib_s", "curl_mib_s"}``; ``vs_limit`` = client / A,
``vs_aria2c`` = client / aria2c, ``vs_single_stream`` = client / curl.
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

import netmodel
from _common import MiB, blake3_file, embedded_stack, emit_result, log, median, timed, write_random_file

from cgstore_client import Client

REPO = "bench/boot"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="blob sizes x this (default 1: 1 GiB + 2 x 256 MiB)")
    parser.add_argument("--c", type=float, default=32, help="per-connection cap C, MiB/s (default 32)")
    parser.add_argument("--a", type=float, default=256, help="aggregate cap A, MiB/s (default 256)")
    parser.add_argument("--latency-ms", type=float, default=20, help="first-byte latency L per request (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each side once per round (default 3)")
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
    listing = out / "urls.txt"
    out.mkdir()
    listing.write_text("".join(f"{blob_url(url, digest)}\n  out={digest[7:]}\n" for digest, _ in blobs))
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
            f"--header=Authorization: Bearer {token}",
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


def main() -> None:
    args = parse_args()
    sizes = [int(1024 * MiB * args.scale), int(256 * MiB * args.scale), int(256 * MiB * args.scale)]
    total = sum(sizes)
    shape = netmodel.Shape(per_connection=args.c * MiB, aggregate=args.a * MiB, latency_s=args.latency_ms / 1000)
    log(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; blobs {[s // MiB for s in sizes]} MiB; "
        f"C {args.c} MiB/s, A {args.a} MiB/s, L {args.latency_ms} ms"
    )
    capacity = netmodel.forwarding_capacity() / MiB
    log(
        f"proxy forwards {capacity:.0f} MiB/s unshaped (3 streams, 1 GiB): "
        + ("at least" if capacity >= 2 * args.a else "BELOW")
        + f" 2·A = {2 * args.a:.0f} MiB/s"
    )

    with tempfile.TemporaryDirectory(prefix="cgstore-bench-net-") as scratch_dir, embedded_stack() as stack:
        scratch = Path(scratch_dir)
        token = stack.mint("bench", f"{REPO.split('/')[0]}/*:read,write")
        blobs = []
        with Client(stack.base_url, token, cache_dir=scratch / "upload-cache") as client:
            for i, size in enumerate(sizes):
                path = scratch / f"blob-{i}"
                write_random_file(path, size)
                blobs.append((client.upload_blob(REPO, path), size))
                path.unlink()
        log(f"uploaded {total / MiB:.0f} MiB as three blobs of {REPO}")

        sides = {"client": run_client, "aria2c": run_aria2c, "curl": run_curl}
        results: dict[str, list[float]] = {name: [] for name in sides}
        host, port = stack.base_url.removeprefix("http://").split(":")
        with netmodel.shaped_proxy(host, int(port), shape) as proxy:
            order = list(sides)
            for round_ in range(args.rounds):
                for name in order[round_ % len(order) :] + order[: round_ % len(order)]:
                    out = scratch / name
                    os.sync()
                    downloader = own_and_children_cpu()
                    with timed({"proxy": proxy.process.pid, "store": stack.server_pid}) as timing:
                        sides[name](proxy.url(), token, blobs, out)
                    timing.cpu_s["downloader"] = own_and_children_cpu() - downloader
                    results[name].append(total / MiB / timing.wall_s)
                    cpu = ", ".join(f"{who} {seconds / timing.wall_s:.0%}" for who, seconds in timing.cpu_s.items())
                    log(
                        f"round {round_} {name}: {timing.wall_s:.2f}s, {results[name][-1]:.1f} MiB/s (CPU of a core: {cpu})"
                    )
                    shutil.rmtree(out)

    best = {name: max(values) for name, values in results.items()}
    for name, values in results.items():
        log(f"{name}: best {best[name]:.1f} MiB/s, median {median(values):.1f} MiB/s")
    log(f"limit: total / A = {total / MiB / args.a:.2f}s ({args.a:.0f} MiB/s)")
    emit_result(
        {
            "vs_limit": round(best["client"] / args.a, 3),
            "vs_aria2c": round(best["client"] / best["aria2c"], 3),
            "vs_single_stream": round(best["client"] / best["curl"], 3),
            "client_mib_s": round(best["client"], 1),
            "aria2c_mib_s": round(best["aria2c"], 1),
            "curl_mib_s": round(best["curl"], 1),
        }
    )


if __name__ == "__main__":
    main()
