"""The S3 driver: any S3-compatible store (AWS S3, MinIO, Ceph, moto) via boto3.

URL: ``s3://bucket[/prefix]?endpoint_url=…&region=…``. A plain object store
(``ObjectStore`` in base.py); verifying blobs is done above it, once for every
driver (``writer.py``). Keys under the optional prefix are the same as the fs
driver's: ``blobs/<hex[:2]>/<hex>`` for blobs, ``uploads/<session_id>/…`` for
staged uploads.

``S3Storage`` is the driver's face: configuration, the object primitives and
the operations. It composes its parts, each with a narrow interface: the
``Bucket`` (clients, keys, the multipart calls, part buffers; ``multipart.py``,
with the streaming writes), the staged uploads (``staging.py``, given the
bucket and the verification above the driver), the error mapping
(``errors.py``), presigning (``../presign.py``).

Flexible checksums (CRC headers, botocore ≥ 1.36) are only sent when an
operation requires them: several S3-compatible stores reject them (RGW 16
has none).

Payload signing (``CGSTORE_S3_PAYLOAD_SIGNING``, ``sign_payloads``): SigV4
signs a hash of each request's body unless told ``UNSIGNED-PAYLOAD``, and
botocore always computes it over plain HTTP, and over HTTPS too when no
checksum header is sent (ours). That SHA-256 is about 1 ms of this process's
CPU per MiB (2.3 under load), more than the rest of a chunk's path (blake3
0.23, one copy into the part buffer), and the S3 server hashes the body again
to check it. What it protects is the bytes between this process and S3: the
store hashed them (blake3) as they arrived and verifies the digest before
anything is made a blob, but it does not read back what S3 stored. So
``auto`` signs where nothing else would catch bytes changed on the way, plain
HTTP to another host (the TCP checksum is 16 bits), and not over HTTPS (TLS
authenticates every byte, as AWS's own SDK reasons: no body signing over TLS
with a checksum) nor to a loopback endpoint (no wire: the bytes go from one
buffer of this host to another). Bytes S3 holds are still checked after the
fact whatever the mode: every client verifies blake3 as it downloads, and
scrub re-hashes stored blobs.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from cgstore.core.errors import Unavailable
from cgstore.settings import parse_s3_url
from cgstore.storage.base import ObjectInfo, ObjectMissing, Storage
from cgstore.storage.presign import BatchPresigner
from cgstore.storage.s3.errors import error_code, is_missing, ping_failure, s3_errors, stream_body
from cgstore.storage.s3.multipart import MIN_PART_BYTES, Bucket, MiB, StreamingUpload
from cgstore.storage.s3.staging import StagedUploads
from cgstore.storage.writer import PendingObject, StagedUpload, StageWriter

DELETE_BATCH_KEYS = 1000  # S3's ceiling on keys per DeleteObjects request
# Assembling a multi-GiB object can take minutes (moto: 7-11 s per GiB); a
# complete cut short by the read timeout would be retried after it succeeded.
COMPLETE_READ_TIMEOUT_S = 300.0
# A writer of this process idle for less than this is between two chunks of a
# live request: sweep_orphans spares it whatever its threshold.
LIVE_WRITER_GRACE_S = 5.0


def parse_storage_url(url: str) -> tuple[str, str, str | None, str | None]:
    """``s3://bucket/some/prefix?endpoint_url=…&region=…`` → (bucket, "some/prefix/", endpoint, region)."""
    bucket, endpoint_url, region = parse_s3_url(url)
    prefix = urlparse(url).path.strip("/")
    return bucket, f"{prefix}/" if prefix else "", endpoint_url, region


def sign_payloads(mode: str, endpoint_url: str | None) -> bool:
    """Whether S3 writes SHA-256-sign their bodies under ``CGSTORE_S3_PAYLOAD_SIGNING`` = ``mode``
    (see "Payload signing" above). No endpoint is AWS's, over HTTPS."""
    if mode in ("always", "never"):
        return mode == "always"
    if mode != "auto":
        raise ValueError(f"payload signing is auto, always or never, not {mode!r}")
    if endpoint_url is None:
        return False
    parsed = urlparse(endpoint_url)
    return parsed.scheme != "https" and not _is_loopback(parsed.hostname or "")


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: it may resolve anywhere
        return False


def _client_config(
    *,
    endpoint_url,
    max_concurrency,
    callers,
    connect_timeout_s,
    read_timeout_s,
    max_attempts,
    payload_signing: str = "auto",
) -> Config:
    options = dict(
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        # Bounded, so a dead store surfaces within seconds instead of stalling requests.
        retries={"total_max_attempts": max_attempts, "mode": "standard"},
        # Every request thread may hold a connection, and several writes run at once, each
        # with max_concurrency part uploads: a smaller pool discards (and later reopens)
        # connections under load, warning "Connection pool is full" (seen in bench/load.py).
        max_pool_connections=max(10, callers + 4 * max_concurrency),
        signature_version="s3v4",
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    # Explicit either way: botocore's own choice signs every body without a checksum header.
    s3_options: dict[str, object] = {"payload_signing_enabled": sign_payloads(payload_signing, endpoint_url)}
    if endpoint_url:
        # S3-compatible stores (MinIO, Ceph, moto) rarely serve virtual-host names.
        s3_options["addressing_style"] = "path"
    options["s3"] = s3_options
    return Config(**options)


class S3Storage(Storage):
    """Objects and staged uploads in one bucket, under an optional key prefix."""

    supports_presign = True

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        public_endpoint_url: str | None = None,
        part_bytes: int = 16 * MiB,
        max_concurrency: int = 4,
        callers: int = 0,  # threads that may call S3 at once (the request threads): sizes the pool
        max_blob_bytes: int | None = None,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 10.0,
        max_attempts: int = 3,
        complete_read_timeout_s: float = COMPLETE_READ_TIMEOUT_S,
        payload_signing: str = "auto",
    ) -> None:
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes must be at least {MIN_PART_BYTES} (S3's minimum part size)")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.part_bytes = part_bytes
        self.max_concurrency = max_concurrency
        self.max_blob_bytes = max_blob_bytes
        config = _client_config(
            endpoint_url=endpoint_url,
            max_concurrency=max_concurrency,
            callers=callers,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            max_attempts=max_attempts,
            payload_signing=payload_signing,
        )
        # A session per storage: boto3's default session is not thread-safe to build clients from.
        session = boto3.session.Session()
        self.client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
        # Only CompleteMultipartUpload and UploadPartCopy may take minutes (see multipart.py).
        complete_client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            config=config.merge(Config(read_timeout=complete_read_timeout_s)),
        )
        self.objects = Bucket(
            self.client,
            complete_client,
            bucket,
            prefix=self.prefix,
            part_bytes=part_bytes,
            max_concurrency=max_concurrency,
        )
        self.staging = StagedUploads(
            self.objects, writer=self.writer, staged_verifier=self.staged_verifier, max_blob_bytes=max_blob_bytes
        )
        # Presigned URLs name the host clients reach, which may differ from ours.
        if public_endpoint_url and public_endpoint_url != endpoint_url:
            public_config = _client_config(
                endpoint_url=public_endpoint_url,
                max_concurrency=1,
                callers=0,
                connect_timeout_s=connect_timeout_s,
                read_timeout_s=read_timeout_s,
                max_attempts=max_attempts,
            )
            self.presign_client = session.client(
                "s3", endpoint_url=public_endpoint_url, region_name=region, config=public_config
            )
        else:
            self.presign_client = self.client
        self._credentials = session.get_credentials()
        self._presigner = BatchPresigner(self.presign_client, self._credentials, self.bucket)

    @classmethod
    def from_settings(cls, settings) -> S3Storage:
        bucket, prefix, endpoint_url, region = parse_storage_url(settings.resolved_storage_url)
        return cls(
            bucket,
            prefix=prefix,
            endpoint_url=endpoint_url,
            region=region,
            public_endpoint_url=settings.s3_public_endpoint_url,
            part_bytes=settings.s3_part_bytes,
            max_concurrency=settings.s3_max_concurrency,
            callers=settings.worker_threads,
            max_blob_bytes=settings.max_blob_bytes,
            payload_signing=settings.s3_payload_signing,
        )

    # -- keys ------------------------------------------------------------------------
    def key(self, relative: str) -> str:
        """The object key of ``relative`` (``blobs/…``, ``uploads/…``) under the prefix."""
        return self.objects.key(relative)

    def blob_key(self, digest: str) -> str:
        """The object key of the blob ``digest``."""
        return self.objects.blob_key(digest)

    # -- object primitives ---------------------------------------------------------------
    def open_write(self, key: str, size_hint: int | None = None) -> PendingObject:
        return StreamingUpload(self.objects, self.key(key), self.objects.part_bytes_for(size_hint))

    def stat(self, key: str) -> int | None:
        return self.objects.object_size(self.key(key))

    def read_range(self, key: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        if end is not None and end == start:  # S3 has no empty Range; still answer "absent"
            if self.stat(key) is None:
                raise ObjectMissing(key)
            return iter(())
        request = {"Bucket": self.bucket, "Key": self.key(key)}
        if start > 0 or end is not None:
            request["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        # The GET is issued now, not on first iteration: an absent object must
        # raise before the caller commits to a response.
        with s3_errors("read"):
            try:
                response = self.client.get_object(**request)
            except ClientError as exc:
                if is_missing(exc):
                    raise ObjectMissing(key) from None
                if error_code(exc)[0] == "InvalidRange":  # start at or past the end
                    return iter(())
                raise
        return stream_body(response["Body"])

    def list_keys(
        self, prefix: str, cursor: str | None = None, limit: int = 1000
    ) -> tuple[list[ObjectInfo], str | None]:
        """Keys in S3's own (UTF-8 byte) order; the cursor is the last key, passed as ``StartAfter``."""
        request = {"Bucket": self.bucket, "Prefix": self.key(prefix), "MaxKeys": min(limit, 1000)}
        if cursor:
            request["StartAfter"] = self.key(cursor)
        with s3_errors("list_objects"):
            response = self.client.list_objects_v2(**request)
        found = [
            ObjectInfo(item["Key"].removeprefix(self.prefix), item["Size"]) for item in response.get("Contents", [])
        ]
        return found, (found[-1].key if found and response.get("IsTruncated") else None)

    def presign_key(self, key: str, ttl_s: int) -> str | None:
        with s3_errors("presign"):  # signing is local; only missing credentials can fail
            return self.presign_client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": self.key(key)}, ExpiresIn=ttl_s
            )

    def presigned_urls(self, digests: list[str], ttl_s: int) -> dict[str, str]:
        unique = list(dict.fromkeys(digests))
        with s3_errors("presign"):
            urls = self._presigner.urls([self.blob_key(d) for d in unique], ttl_s)
        return dict(zip(unique, urls, strict=True))

    def delete_key(self, key: str) -> None:
        with s3_errors("delete"):
            self.client.delete_object(Bucket=self.bucket, Key=self.key(key))

    def delete_many(self, digests: list[str]) -> None:
        # One request per 1000 keys (delete_objects' limit); S3 reports no error
        # for a key that is already gone, which is what a retried batch needs.
        for start in range(0, len(digests), DELETE_BATCH_KEYS):
            keys = [{"Key": self.blob_key(d)} for d in digests[start : start + DELETE_BATCH_KEYS]]
            with s3_errors("delete_objects"):
                response = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
            if response.get("Errors"):
                raise Unavailable("could not delete blobs", errors=response["Errors"][:5])

    # -- operations ------------------------------------------------------------------------
    def ping(self) -> None:
        with s3_errors("ping"):
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except ClientError as exc:  # a missing bucket is an outage to the service, too
                code, status = error_code(exc)
                raise Unavailable(ping_failure(code, status), bucket=self.bucket, code=code, status=status) from exc

    def sweep_orphans(self, older_than_s: float) -> int:
        """Abort blob multipart uploads (processes killed mid-write) older than ``older_than_s``.

        This process's own uploads count as old only once their writer has been
        idle that long (at least ``LIVE_WRITER_GRACE_S``), whatever ``Initiated``
        says (moto reports 2010 for all of them).
        """
        cutoff = datetime.now(UTC) - timedelta(seconds=older_than_s)
        idle_s = max(older_than_s, LIVE_WRITER_GRACE_S)
        return self.objects.abort_multipart_uploads(self.key("blobs/"), initiated_before=cutoff, spare_idle_s=idle_s)

    # -- staged uploads (staging.py) ---------------------------------------------------------
    def stage_begin(self, session_id: str) -> StagedUpload:
        return self.staging.stage_begin(session_id)

    def _stage_writer(self, staged: StagedUpload) -> StageWriter:  # the hook base.Storage.stage_append calls
        return self.staging.chunk_writer(staged)

    def stage_discard(self, before: StagedUpload, after: StagedUpload) -> None:
        self.staging.stage_discard(before, after)

    def stage_recorded(self, before: StagedUpload, after: StagedUpload) -> None:
        self.staging.stage_recorded(before, after)

    def stage_commit(self, staged: StagedUpload, digest: str) -> int:
        return self.staging.stage_commit(staged, digest)

    def stage_abort(self, staged: StagedUpload) -> None:
        self.staging.stage_abort(staged)

    def staged_sessions(self, written_before: datetime) -> list[str]:
        return self.staging.staged_sessions(written_before)
