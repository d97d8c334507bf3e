"""What a failed or abandoned upload may have left in storage: must be nothing."""

from __future__ import annotations

from cgstore.storage.fs import FileStorage


def leftover_writes(storage) -> list[str]:
    """Unfinished blob writes: temp files (fs) or open multipart uploads (S3)."""
    if isinstance(storage, FileStorage):
        return _files(storage.tmp_dir)
    pending = storage.client.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", [])
    return [u["Key"] for u in pending]


def leftover_staging(storage) -> list[str]:
    """Staged bytes of upload sessions, plus unfinished writes."""
    if isinstance(storage, FileStorage):
        return _files(storage.uploads_dir) + leftover_writes(storage)
    listed = storage.client.list_objects_v2(Bucket=storage.bucket, Prefix=storage.key("uploads/"))
    return [o["Key"] for o in listed.get("Contents", [])] + leftover_writes(storage)


def _files(directory) -> list[str]:
    return [str(p) for p in directory.rglob("*") if p.is_file()] if directory.exists() else []


def staged_session_bytes(storage, session_id: str) -> int | None:
    """How many bytes one session has staged, as storage holds them (not as the API says).

    fs: the size of its staging file (None when the file is gone). S3: the total
    size of its chunk objects plus the parts of any multipart upload still open
    under its prefix (None when nothing is left under the prefix).
    """
    if isinstance(storage, FileStorage):
        path = storage.uploads_dir / session_id
        return path.stat().st_size if path.exists() else None
    prefix = storage.key(f"uploads/{session_id}/")
    objects = storage.client.list_objects_v2(Bucket=storage.bucket, Prefix=prefix).get("Contents", [])
    uploads = storage.client.list_multipart_uploads(Bucket=storage.bucket, Prefix=prefix).get("Uploads", [])
    if not objects and not uploads:
        return None
    parts = 0
    for upload in uploads:
        listed = storage.client.list_parts(Bucket=storage.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        parts += sum(part["Size"] for part in listed.get("Parts", []))
    return sum(item["Size"] for item in objects) + parts
