"""The worker client against raw boto3 and against compiling locally, PostgreSQL + S3, in one run.

    python bench/client.py                                   # 1 GiB artifact + 2 x 256 MiB components
    python bench/client.py --artifact-mib 128 --component-mib 32 --reps 1   # a quick check

Starts its own PostgreSQL database, Ceph's RADOS Gateway (S3) and the store (PostgreSQL + S3,
``redirect_downloads`` on) as a separate process, and stops them afterwards.

The published compiled graph is real: a model with two 8192x8192 float32
weights (256 MiB each at the default size) is exported and minted with
``package_compiled_graph``; its two weights are the two components (bound by
name, as the record's binding table says), and the archive is padded to the
artifact size with an extra AOTI file (fresh random bytes per repetition, so
every repetition uploads and downloads new blobs: the store never rewrites a
blob it holds).

Figures (each repetition alternates which side goes first, and the three cold
boots run A B C A B C C B A C B A; ratios of the best; every timed run starts
after ``os.sync()``):
- ``cold_boot_ratio``: ``client.load`` into an empty cache (one resolve, the
  record, three verified downloads 4-wide: hashed, fsynced, renamed) vs boto3
  doing that work by hand (``s3_get_verified``: ``get_object`` of the same
  three objects, three threads, each into a temp file beside its destination,
  blake3 while writing, fsync, rename on a match, directory fsync).
  Throughput ratio, target >= 0.9.
- ``cold_boot_ratio_vs_unverified``: the same cold boot vs raw boto3
  ``get_object`` of the three objects to files, no hash, no fsync: the price
  of verification and durability more than of the client.
- ``warm_boot_ratio``: ``client.load`` with everything cached (resolve, cached
  record, verification stamps hold) vs one blake3 pass over the same bytes.
  Time ratio, target <= 1.2. (A warm boot whose stamps were broken re-hashes
  everything; its time is printed too.)
- ``publish_ratio``: ``client.publish`` (local static read, key, hashing, the
  missing-blob check, resumable sessions for the three blobs 4-wide, the
  record PUT with the store's admission) vs raw boto3 ``upload_file`` of the
  same three files, three threads. Throughput ratio, target >= 0.8.
- ``speedup_vs_compile``: for a real small model (an MLP), the time to a first
  compiled call by compiling locally (export + AOTI compile + load + bind +
  call) / by ``client.load`` + ``load_compiled`` + call from the store with a
  cold cache. Target >= 10.

Last line: ``{"cold_boot_ratio", "warm_boot_ratio", "publish_ratio", "speedup_vs_compile",
"cold_boot_ratio_vs_unverified"}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import torch
from _common import MiB, emit_result, log, median, production_stack, s3_get_unverified, s3_get_verified
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from cgstore_client import Client, Want
from cgstore_client.archive import graph_digest_from_program
from cgstore_client.components import save_tensors
from cgstore_client.environment import environment_sm
from cgstore_client.keys import ck1
from cgstore_client.mint import package_compiled_graph
from cgstore_client.worker.cache import hash_file
from cgstore_client.worker.loader import load_compiled

OWNER = "bench"
FAMILY = "bench-family"
ENVELOPE = {"shapes": [[64, 64]], "text_len": 0}  # batch 1: the big graph's (static) batch
#: The small model is exported on a batch of 4 (static): its envelope promises exactly that (admission holds it).
SMALL_ENVELOPE = {**ENVELOPE, "batch_sizes": [4]}
TOOLCHAIN = {"torch": torch.__version__}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact-mib", type=int, default=1024, help="artifact size in MiB (default 1024)")
    parser.add_argument("--component-mib", type=int, default=256, help="each component's size in MiB (default 256)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions (default 2)")
    parser.add_argument(
        "--chunked-threshold-mib",
        type=int,
        default=None,
        help="blobs from this size go through resumable sessions (default: the client's, 64 MiB)",
    )
    return parser.parse_args()


# -- models -------------------------------------------------------------------------------------


class TwoWeights(torch.nn.Module):
    """Two square weights: each one component of ``side * side * 4`` bytes."""

    def __init__(self, side: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(side, side, bias=False)
        self.b = torch.nn.Linear(side, side, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def compile_locally(model: torch.nn.Module, x: torch.Tensor, path: Path) -> tuple[float, torch.export.ExportedProgram]:
    """Export + AOTI compile (the mint) + load + bind + first call: what a worker without the store does."""
    started = time.perf_counter()
    program = torch.export.export(model, (x,))
    package_compiled_graph(program, path)
    compiled = torch._inductor.aoti_load_package(str(path))
    compiled.load_constants(dict(model.state_dict()), check_full_update=True)
    compiled(x)
    return time.perf_counter() - started, program


# -- the big publication --------------------------------------------------------------------------


def padded_archive(minted: Path, out: Path, size: int) -> None:
    """``minted`` plus one AOTI file of fresh random bytes so the archive is ``size`` bytes (about)."""
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    with zipfile.ZipFile(minted) as source, open(out, "wb") as fh, PT2ArchiveWriter(fh) as writer:
        for info in source.infolist():
            name = info.filename.split("/", 1)[1]
            if name not in (
                "archive_format",
                "archive_version",
                ".data/version",
                "byteorder",
                ".data/serialization_id",
            ):
                writer.write_bytes(name, source.read(info))
        # Zero first bytes: never mistaken for a pickle stream by the reader's magic check.
        padding = max(0, size - minted.stat().st_size)
        writer.write_bytes("data/aotinductor/model/padding.bin", bytes(16) + os.urandom(max(0, padding - 16)))


def fresh_components(side: int, directory: Path) -> dict[str, Path]:
    paths = {}
    for name in ("a", "b"):
        paths[name] = directory / f"{name}.safetensors"
        save_tensors({f"{name}.weight": torch.randn(side, side)}, paths[name])
    return paths


def in_parallel(*jobs) -> None:
    with ThreadPoolExecutor(len(jobs)) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


def timed(run) -> float:
    # Each run starts with no dirty pages left by the one before (the freshly written
    # inputs, the other side's downloads): their writeback would be billed to this run.
    os.sync()
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    args = parse_args()
    artifact_size = args.artifact_mib * MiB
    side = int((args.component_mib * MiB // 4) ** 0.5)
    started = time.perf_counter()
    sm = environment_sm()
    with tempfile.TemporaryDirectory(prefix="cgstore-bench-client-") as scratch_dir:
        scratch = Path(scratch_dir)
        model, x = small_model(), torch.randn(4, 64)
        compile_s, small_program = compile_locally(model, x, scratch / "small.pt2")
        log(f"local path to a first compiled call (export + compile + load + bind + call): {compile_s:.1f}s")
        big_program = torch.export.export(TwoWeights(side), (torch.randn(1, side),))
        package_compiled_graph(big_program, scratch / "big.pt2")
        big_graph = graph_digest_from_program(big_program)

        with production_stack(redirect_downloads=True, reaper_interval_s=3600) as stack:
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

            # Headline: the small model from the store, cold cache, in this process.
            small_key = ck1(graph_digest_from_program(small_program), SMALL_ENVELOPE, sm, TOOLCHAIN)
            with Client(stack.base_url, token, cache_dir=scratch / "mint-cache") as client:
                client.publish(
                    f"{OWNER}/small",
                    scratch / "small.pt2",
                    family=FAMILY,
                    envelope=SMALL_ENVELOPE,
                    toolchain=TOOLCHAIN,
                    sm=sm,
                )
            begun = time.perf_counter()
            with Client(stack.base_url, token, cache_dir=scratch / "small-cache") as client:
                (loaded,) = client.load(FAMILY, [Want(small_key, mandatory=True)])
            compiled = load_compiled(loaded, model.state_dict())
            compiled(x)
            store_s = time.perf_counter() - begun
            log(f"store path to a first compiled call (load + bind + call, cold cache): {store_s:.2f}s")

            results: dict[str, list[float]] = {
                k: [] for k in ("publish", "boto_up", "cold", "boto_down", "boto_raw", "warm", "hash")
            }
            for rep in range(args.reps):
                repo = f"{OWNER}/big-{rep}"
                # One key per repetition (its envelope differs, in guidance: the graph fixes its batch at 1):
                # each resolves to its own fresh blobs.
                envelope = {**ENVELOPE, "guidance": [rep + 1]}
                big_key = ck1(big_graph, envelope, sm, TOOLCHAIN)
                padded_archive(scratch / "big.pt2", scratch / "artifact.pt2", artifact_size)
                components = fresh_components(side, scratch)
                files = [scratch / "artifact.pt2", *components.values()]
                total = sum(p.stat().st_size for p in files)
                digests, sizes = zip(*(hash_file(p) for p in files), strict=True)

                def ours_publish() -> None:
                    threshold = None if args.chunked_threshold_mib is None else args.chunked_threshold_mib * MiB
                    with Client(
                        stack.base_url, token, cache_dir=scratch / "mint-cache", chunked_threshold=threshold
                    ) as client:
                        published = client.publish(
                            repo,
                            files[0],
                            family=FAMILY,
                            envelope=envelope,
                            toolchain=TOOLCHAIN,
                            sm=sm,
                            components=components,
                        )
                    assert published.key == big_key and published.status == "created"

                def boto_publish() -> None:
                    in_parallel(
                        *(
                            lambda p=p: s3.upload_file(
                                str(p), stack.bucket, f"baseline/{p.name}", Config=TransferConfig()
                            )
                            for p in files
                        )
                    )

                pair = [("publish", ours_publish), ("boto_up", boto_publish)]
                for name, run in pair if rep % 2 == 0 else reversed(pair):
                    results[name].append(total / MiB / timed(run))

                cache = scratch / f"cache-{rep}"

                def ours_cold() -> None:
                    shutil.rmtree(cache, ignore_errors=True)  # every cold boot starts from an empty cache
                    with Client(stack.base_url, token, cache_dir=cache) as client:
                        (got,) = client.load(FAMILY, [Want(big_key, mandatory=True)])
                    assert got.artifact_path.stat().st_size == files[0].stat().st_size

                def blob_key(digest: str) -> str:
                    return f"blobs/{digest[7:9]}/{digest[7:]}"

                def boto_cold() -> None:
                    in_parallel(
                        *(
                            lambda d=d, i=i, n=n: s3_get_verified(
                                s3, stack.bucket, blob_key(d), boto_dir / f"boto-{i}.bin", d, n
                            )
                            for i, (d, n) in enumerate(zip(digests, sizes, strict=True))
                        )
                    )

                def boto_raw() -> None:
                    in_parallel(
                        *(
                            lambda d=d, i=i: s3_get_unverified(s3, stack.bucket, blob_key(d), scratch / f"raw-{i}.bin")
                            for i, d in enumerate(digests)
                        )
                    )

                # Each side downloads four times, twice in odd and twice in even positions
                # (A B C A B C C B A C B A): on this VM downloads alternate between fast and
                # up to 3x slower ones, whichever side runs (seen with boto3 alone, too).
                boto_dir = scratch / f"boto-{rep}"
                boto_dir.mkdir()
                sides = [("cold", ours_cold), ("boto_down", boto_cold), ("boto_raw", boto_raw)]
                sides = sides if rep % 2 == 0 else sides[::-1]
                for name, run in sides * 2 + sides[::-1] * 2:
                    results[name].append(total / MiB / timed(run))

                def ours_warm() -> None:
                    with Client(stack.base_url, token, cache_dir=cache) as client:
                        client.load(FAMILY, [Want(big_key, mandatory=True)])

                cached = [cache / "blobs" / "blake3" / d[7:] for d in digests]
                results["warm"].append(timed(ours_warm))
                results["hash"].append(timed(lambda: [hash_file(p) for p in cached]))
                shutil.rmtree(cache / "stamps")
                log(f"rep {rep} warm boot with broken stamps (re-hashes everything): {timed(ours_warm):.2f}s")
                for key in [f"baseline/{p.name}" for p in files] + [blob_key(d) for d in digests]:
                    s3.delete_object(Bucket=stack.bucket, Key=key)
                shutil.rmtree(cache)
                shutil.rmtree(boto_dir)
                for i in range(len(digests)):
                    (scratch / f"raw-{i}.bin").unlink()
                log(
                    f"rep {rep}: "
                    + ", ".join(f"{k} {' '.join(f'{x:.2f}' for x in v)}" for k, v in results.items())
                    + "  (MiB/s for publish/boto_up/cold/boto_down/boto_raw, seconds for warm/hash)"
                )

    figures = {
        "cold_boot_ratio": round(max(results["cold"]) / max(results["boto_down"]), 3),
        "warm_boot_ratio": round(min(results["warm"]) / min(results["hash"]), 3),
        "publish_ratio": round(max(results["publish"]) / max(results["boto_up"]), 3),
        "speedup_vs_compile": round(compile_s / store_s, 1),
        "cold_boot_ratio_vs_unverified": round(max(results["cold"]) / max(results["boto_raw"]), 3),
    }
    log(
        f"median ratios: cold boot {median(results['cold']) / median(results['boto_down']):.3f},"
        f" cold boot vs unverified {median(results['cold']) / median(results['boto_raw']):.3f}"
    )
    log(
        f"{total / MiB:.0f} MiB per boot; total {time.perf_counter() - started:.0f}s,"
        f" load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    emit_result(figures)


if __name__ == "__main__":
    main()
