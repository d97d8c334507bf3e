"""Blob throughput through the store vs raw boto3, against the same S3 (Ceph's RADOS Gateway), and the server's peak RSS.

    python bench/blobs.py                 # 1 GiB blob (default)
    python bench/blobs.py --size-mib 64   # a quick check

Starts its own PostgreSQL database, Ceph's RADOS Gateway and the store (PostgreSQL + S3,
``redirect_downloads`` on) as a separate process, and stops them afterwards.

Ours:
- upload: the file streamed from disk by httpx in 1 MiB chunks, one monolithic
  ``PUT /v1/repos/bench/blobs/blobs/{digest}`` with Content-Length (the store
  hashes it on the way in and writes it to S3 as a multipart upload);
- download: ``Client.fetch_blob`` into a fresh cache, the verified download a
  worker runs: the store answers 307 to a presigned URL, the client follows it
  (without the cap-token), hashes every byte into a temp file, fsyncs it and
  renames it into place only when the blake3 digest and size match.

Baselines (raw boto3, same bytes, different key, same S3):
- upload: ``upload_file`` with the default ``TransferConfig``;
- download (``download_ratio``): ``get_object`` doing by hand the work our
  download does (``s3_get_verified``): the same single stream from S3 into a
  temp file in the destination's directory, blake3 of the stream while
  writing, fsync, rename on a digest and size match, fsync of the directory;
- download (``download_ratio_vs_unverified``): ``get_object`` streamed into a
  file with no hash and no fsync (``s3_get_unverified``): what verification
  and durability cost, not what the client costs.
(``download_fileobj`` is not the baseline: the store's download is one verified
stream, so the fair comparison is boto3 doing the same.)
Both boto3 and the store's S3 client send flexible checksums only when required
(the store configures that; the baseline does the same so only the store's
overhead is compared, not botocore's CRC trailers).

Each repetition uses fresh bytes (the first 16 bytes of the file carry the
repetition number, the digest is recomputed untimed) because the store never
rewrites a blob it already holds; the objects are deleted from S3 after each
repetition so the OSD's sparse block stays bounded. Each repetition is one upload pair and
``--download-reps`` download rounds of the three downloads (downloads are
fast, so noisier); each round runs them forwards or backwards, alternately.
Ratios are of the best throughput of each side (medians are printed too: on a
shared machine other load only ever slows a run down); the server's RSS is
sampled every 20 ms for the whole run.

Last line: ``{"upload_ratio": …, "download_ratio": …, "server_peak_rss_mib": …, "download_ratio_vs_unverified": …}``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import boto3
import httpx
from _common import (
    MiB,
    RssSampler,
    blake3_file,
    emit_result,
    log,
    median,
    production_stack,
    read_chunks,
    rss_mib,
    s3_get_unverified,
    s3_get_verified,
    timed,
    write_random_file,
)
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from cgstore_client import Client

OWNER, REPO = "bench", "blobs"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="blob size in MiB (default 1024)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement (default 3)")
    parser.add_argument(
        "--download-reps", type=int, default=3, help="rounds of the three downloads per repetition (default 3)"
    )
    return parser.parse_args()


def tag_file(path: Path, rep: int) -> str:
    """Make repetition ``rep``'s bytes unique (first 16 bytes) and return their digest (untimed)."""
    with open(path, "r+b") as f:
        f.write(f"cgstore-bench{rep:03d}".encode()[:16].ljust(16, b"\0"))
    return blake3_file(path)


def our_upload(client: httpx.Client, path: Path, size: int, digest: str) -> None:
    response = client.put(
        f"/v1/repos/{OWNER}/{REPO}/blobs/{digest}",
        content=read_chunks(path, MiB),
        headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
    )
    if response.status_code != 201:
        raise SystemExit(f"upload failed: {response.status_code} {response.text[:500]}")


def our_download(base_url: str, token: str, size: int, digest: str, cache: Path) -> None:
    """The client's verified download: 307 followed, bytes hashed into a temp file, renamed on a match."""
    with Client(base_url, token, cache_dir=cache) as client:
        client.fetch_blob(f"{OWNER}/{REPO}", digest, size).unlink()


def boto_download(s3, bucket: str, key: str, size: int, dest: Path) -> None:
    """Raw boto3 GET of the same bytes into a file: the same single stream from S3, no hash."""
    received = s3_get_unverified(s3, bucket, key, dest)
    dest.unlink()
    if received != size:
        raise SystemExit(f"baseline download short: {received} of {size}")


def boto_verified_download(s3, bucket: str, key: str, size: int, digest: str, dest: Path) -> None:
    """boto3 GET doing our download's work by hand: hashed, fsynced, renamed on a match."""
    s3_get_verified(s3, bucket, key, dest, digest, size)
    dest.unlink()


def mib_per_s(size: int, seconds: float) -> float:
    return size / MiB / seconds


def main() -> None:
    args = parse_args()
    size = args.size_mib * MiB
    log(
        f"blob size {args.size_mib} MiB, {args.reps} repetitions x (1 upload pair + {args.download_reps} rounds of"
        f" 3 downloads),"
        f" load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    started = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="cgstore-bench-") as scratch:
        path = Path(scratch) / "blob.bin"
        with timed({}) as prep:
            write_random_file(path, size)
        log(f"test data written in {prep.wall_s:.1f}s (16 MiB random blocks)")

        # The reaper is off for the run: it measures nothing here.
        with production_stack(redirect_downloads=True, reaper_interval_s=3600) as stack:
            server_pid = stack.server_pid
            watch = {"server": server_pid, **stack.s3_pids, "client": os.getpid()}
            token = stack.mint("bench", f"{OWNER}/*:read,write")
            s3 = boto3.session.Session().client(
                "s3",
                endpoint_url=stack.s3.endpoint_url,
                region_name=stack.s3.region,
                aws_access_key_id=stack.s3.access_key,
                aws_secret_access_key=stack.s3.secret_key,
                config=Config(
                    request_checksum_calculation="when_required", response_checksum_validation="when_required"
                ),
            )
            idle_rss = rss_mib(server_pid)
            log(f"server idle RSS baseline: {idle_rss:.1f} MiB (pid {server_pid})")

            results: dict[str, list[float]] = {
                "ours_up": [],
                "boto_up": [],
                "ours_down": [],
                "boto_down": [],
                "boto_raw": [],
            }
            timeout = httpx.Timeout(300.0, connect=10.0)
            headers = {"Authorization": f"Bearer {token}"}

            def measure(rep: int, name: str, run) -> None:
                with timed(watch) as t:
                    run()
                results[name].append(mib_per_s(size, t.wall_s))
                cpu = " ".join(f"{k}={v:.2f}s" for k, v in t.cpu_s.items())
                log(
                    f"rep {rep} {name:9s} {t.wall_s:6.2f}s {mib_per_s(size, t.wall_s):7.1f} MiB/s"
                    f"  cpu: {cpu}  server rss peak so far {rss.peak_mib:.1f} MiB"
                )

            with (
                httpx.Client(base_url=stack.base_url, headers=headers, timeout=timeout) as client,
                RssSampler(server_pid, interval_s=0.02) as rss,
            ):
                for rep in range(args.reps):
                    digest = tag_file(path, rep)
                    our_key = f"blobs/{digest[7:9]}/{digest[7:]}"
                    boto_key = f"baseline/{digest[7:]}"
                    uploads = [
                        ("ours_up", lambda: our_upload(client, path, size, digest)),
                        ("boto_up", lambda: s3.upload_file(str(path), stack.bucket, boto_key, Config=TransferConfig())),
                    ]
                    downloads = [
                        (
                            "ours_down",
                            lambda: our_download(stack.base_url, token, size, digest, Path(scratch) / "cache"),
                        ),
                        (
                            "boto_down",
                            lambda: boto_verified_download(
                                s3, stack.bucket, boto_key, size, digest, Path(scratch) / "boto.bin"
                            ),
                        ),
                        (
                            "boto_raw",
                            lambda: boto_download(s3, stack.bucket, boto_key, size, Path(scratch) / "raw.bin"),
                        ),
                    ]
                    for name, run in uploads if rep % 2 == 0 else reversed(uploads):
                        measure(rep, name, run)
                    for turn in range(args.download_reps):
                        for name, run in downloads if (rep + turn) % 2 == 0 else reversed(downloads):
                            measure(rep, name, run)
                    s3.delete_object(Bucket=stack.bucket, Key=our_key)
                    s3.delete_object(Bucket=stack.bucket, Key=boto_key)

            best = {name: max(values) for name, values in results.items()}
            for name, values in results.items():
                log(
                    f"{name:9s} best {best[name]:7.1f} MiB/s  median {median(values):7.1f} MiB/s"
                    f"  (all: {', '.join(f'{v:.1f}' for v in values)})"
                )
            log(
                f"median ratios: upload {median(results['ours_up']) / median(results['boto_up']):.3f},"
                f" download {median(results['ours_down']) / median(results['boto_down']):.3f},"
                f" download vs unverified {median(results['ours_down']) / median(results['boto_raw']):.3f}"
            )
            log(f"server RSS: idle {idle_rss:.1f} MiB, peak {rss.peak_mib:.1f} MiB over {rss.samples} samples")
    log(f"total {time.perf_counter() - started:.0f}s, load average {os.getloadavg()[0]:.2f}")

    emit_result(
        {
            "upload_ratio": round(best["ours_up"] / best["boto_up"], 3),
            "download_ratio": round(best["ours_down"] / best["boto_down"], 3),
            "server_peak_rss_mib": round(rss.peak_mib, 1),
            "download_ratio_vs_unverified": round(best["ours_down"] / best["boto_raw"], 3),
        }
    )


if __name__ == "__main__":
    main()
