"""Blob throughput through the store vs raw boto3, against the same moto_server, and the server's peak RSS.

    python bench/blobs.py                 # 1 GiB blob (default)
    python bench/blobs.py --size-mib 64   # a quick check

Starts its own PostgreSQL database, moto_server and the store (PostgreSQL + S3,
``redirect_downloads`` on) as a separate process, and stops them afterwards.

Ours:
- upload: the file streamed from disk by httpx in 1 MiB chunks, one monolithic
  ``PUT /v1/repos/bench/blobs/blobs/{digest}`` with Content-Length (the store
  hashes it on the way in and writes it to S3 as a multipart upload);
- download: ``GET`` of the same blob following the 307 to the presigned URL,
  streamed, blake3 computed over every byte and checked against the digest
  (a verified download is the product).

Baseline (raw boto3, same bytes, different key, same moto_server):
- upload: ``upload_file`` with the default ``TransferConfig``;
- download: ``get_object`` streamed to a discarding sink (the same single
  stream from moto that our download reads, without a hash), or with
  ``--download-baseline download_fileobj`` boto3's parallel ranged download.
Both boto3 and the store's S3 client send flexible checksums only when required
(the store configures that; the baseline does the same so only the store's
overhead is compared, not botocore's CRC trailers).

Each repetition uses fresh bytes (the first 16 bytes of the file carry the
repetition number, the digest is recomputed untimed) because the store never
rewrites a blob it already holds; the objects are deleted from moto after each
repetition so its memory stays bounded. Ours and the baseline alternate order.
Ratios are of median throughputs; the server's RSS is sampled every 20 ms for
the whole run.

Last line: ``{"upload_ratio": …, "download_ratio": …, "server_peak_rss_mib": …}``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import blake3
import boto3
import httpx
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

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
    timed,
    write_random_file,
)

OWNER, REPO = "bench", "blobs"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="blob size in MiB (default 1024)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement (default 3)")
    parser.add_argument(
        "--download-baseline",
        choices=["get_object", "download_fileobj"],
        default="get_object",
        help="what raw boto3 download our download is compared with (default get_object, streamed)",
    )
    return parser.parse_args()


class _Discard:
    """A seekable sink for download_fileobj that keeps nothing."""

    def write(self, data) -> int:
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return offset

    def tell(self) -> int:
        return 0

    def seekable(self) -> bool:
        return True


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


def our_download(client: httpx.Client, size: int, digest: str) -> None:
    hasher = blake3.blake3()
    received = 0
    with client.stream("GET", f"/v1/repos/{OWNER}/{REPO}/blobs/{digest}", follow_redirects=True) as response:
        if response.status_code != 200:
            response.read()
            raise SystemExit(f"download failed: {response.status_code} {response.text[:500]}")
        if not response.history or response.history[0].status_code != 307:
            raise SystemExit("download was not redirected to a presigned URL (redirect_downloads off?)")
        for chunk in response.iter_raw(MiB):
            hasher.update(chunk)
            received += len(chunk)
    actual = "blake3:" + hasher.hexdigest()
    if received != size or actual != digest:
        raise SystemExit(f"download NOT verified: {received} bytes, {actual} != {digest}")


def boto_download(s3, bucket: str, key: str, size: int, mode: str) -> None:
    if mode == "download_fileobj":
        s3.download_fileobj(bucket, key, _Discard(), Config=TransferConfig())
        return
    body = s3.get_object(Bucket=bucket, Key=key)["Body"]
    received = 0
    for chunk in body.iter_chunks(MiB):
        received += len(chunk)
    if received != size:
        raise SystemExit(f"baseline download short: {received} of {size}")


def mib_per_s(size: int, seconds: float) -> float:
    return size / MiB / seconds


def main() -> None:
    args = parse_args()
    size = args.size_mib * MiB
    log(f"blob size {args.size_mib} MiB, {args.reps} repetitions, download baseline: {args.download_baseline}")

    with tempfile.TemporaryDirectory(prefix="cgstore-bench-") as scratch:
        path = Path(scratch) / "blob.bin"
        with timed({}) as prep:
            write_random_file(path, size)
        log(f"test data written in {prep.wall_s:.1f}s (16 MiB random blocks)")

        with production_stack(redirect_downloads=True) as stack:
            server_pid, moto_pid = stack.server_pid, stack.moto_pid
            watch = {"server": server_pid, "moto": moto_pid, "client": os.getpid()}
            token = stack.mint("bench", f"{OWNER}/*:read,write")
            s3 = boto3.session.Session().client(
                "s3",
                endpoint_url=stack.s3.endpoint_url,
                region_name=stack.s3.region,
                aws_access_key_id="test",
                aws_secret_access_key="test",
                config=Config(request_checksum_calculation="when_required", response_checksum_validation="when_required"),
            )
            idle_rss = rss_mib(server_pid)
            log(f"server idle RSS baseline: {idle_rss:.1f} MiB (pid {server_pid})")

            results: dict[str, list[float]] = {"ours_up": [], "boto_up": [], "ours_down": [], "boto_down": []}
            timeout = httpx.Timeout(300.0, connect=10.0)
            headers = {"Authorization": f"Bearer {token}"}
            with httpx.Client(base_url=stack.base_url, headers=headers, timeout=timeout) as client, RssSampler(
                server_pid, interval_s=0.02
            ) as rss:
                for rep in range(args.reps):
                    digest = tag_file(path, rep)
                    our_key = f"blobs/{digest[7:9]}/{digest[7:]}"
                    boto_key = f"baseline/{digest[7:]}"
                    ours_first = rep % 2 == 0

                    uploads = [
                        ("ours_up", lambda: our_upload(client, path, size, digest)),
                        ("boto_up", lambda: s3.upload_file(str(path), stack.bucket, boto_key, Config=TransferConfig())),
                    ]
                    downloads = [
                        ("ours_down", lambda: our_download(client, size, digest)),
                        ("boto_down", lambda: boto_download(s3, stack.bucket, boto_key, size, args.download_baseline)),
                    ]
                    for phase in (uploads, downloads):
                        for name, run in phase if ours_first else reversed(phase):
                            with timed(watch) as t:
                                run()
                            results[name].append(mib_per_s(size, t.wall_s))
                            cpu = " ".join(f"{k}={v:.2f}s" for k, v in t.cpu_s.items())
                            log(
                                f"rep {rep} {name:9s} {t.wall_s:6.2f}s {mib_per_s(size, t.wall_s):7.1f} MiB/s"
                                f"  cpu: {cpu}  server rss peak so far {rss.peak_mib:.1f} MiB"
                            )
                    s3.delete_object(Bucket=stack.bucket, Key=our_key)
                    s3.delete_object(Bucket=stack.bucket, Key=boto_key)

            med = {name: median(values) for name, values in results.items()}
            for name, value in med.items():
                log(f"median {name:9s} {value:7.1f} MiB/s  (all: {', '.join(f'{v:.1f}' for v in results[name])})")
            log(f"server RSS: idle {idle_rss:.1f} MiB, peak {rss.peak_mib:.1f} MiB over {rss.samples} samples")

    emit_result(
        {
            "upload_ratio": round(med["ours_up"] / med["boto_up"], 3),
            "download_ratio": round(med["ours_down"] / med["boto_down"], 3),
            "server_peak_rss_mib": round(rss.peak_mib, 1),
        }
    )


if __name__ == "__main__":
    main()
