"""Damage done behind a running store's back: the directory's files or the bucket's objects, changed directly.

For the scrub and the admin views' tests: the store learns of it only by
reading its bytes back.
"""

from __future__ import annotations

from pathlib import Path

from cgstore.storage.hashing import blob_key, parse_digest


def _s3_client(store):
    """A boto3 client of its own (not the store's) on the store's endpoint, with the
    keys the store signs with (this process's ``AWS_*`` variables)."""
    import boto3
    from botocore.config import Config

    storage = store.context.storage
    return boto3.client(
        "s3",
        endpoint_url=storage.client.meta.endpoint_url,
        region_name=storage.client.meta.region_name,
        config=Config(request_checksum_calculation="when_required", response_checksum_validation="when_required"),
    )


def flip_byte(store, digest: str, data: bytes, at: int = -1) -> None:
    """Store ``data`` with one bit of byte ``at`` flipped: same size, another digest."""
    damaged = bytearray(data)
    damaged[at] ^= 0x01
    put_raw(store, digest, bytes(damaged))


def put_raw(store, digest: str, data: bytes) -> None:
    """Write ``data`` as the stored bytes of ``digest``, unverified."""
    storage = store.context.storage
    if store.is_s3:
        _s3_client(store).put_object(Bucket=storage.bucket, Key=storage.blob_key(digest), Body=data)
    else:
        Path(storage.root, blob_key(parse_digest(digest))).write_bytes(data)


def delete_object(store, digest: str) -> None:
    """Remove the stored bytes of ``digest``; the blob row stays."""
    storage = store.context.storage
    if store.is_s3:
        _s3_client(store).delete_object(Bucket=storage.bucket, Key=storage.blob_key(digest))
    else:
        Path(storage.root, blob_key(parse_digest(digest))).unlink()


def rewrite_s3_object_multipart(store, digest: str, data: bytes) -> str:
    """Overwrite the S3 object of ``digest`` with ``data`` through a multipart upload of another
    S3 client (S3's own write path, not the store's); returns the new object's ETag."""
    storage = store.context.storage
    s3, key = _s3_client(store), storage.blob_key(digest)
    upload = s3.create_multipart_upload(Bucket=storage.bucket, Key=key)["UploadId"]
    part = s3.upload_part(Bucket=storage.bucket, Key=key, UploadId=upload, PartNumber=1, Body=data)
    s3.complete_multipart_upload(
        Bucket=storage.bucket,
        Key=key,
        UploadId=upload,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
    )
    # RGW 16 answers CompleteMultipartUpload with an empty ETag; HEAD has the "-1" one.
    return s3.head_object(Bucket=storage.bucket, Key=key)["ETag"]
