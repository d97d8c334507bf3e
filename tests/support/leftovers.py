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
