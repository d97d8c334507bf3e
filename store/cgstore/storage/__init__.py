"""Object storage for blob bytes: a local directory or any S3-compatible store.

``open_storage(settings)`` picks the backend from ``CGSTORE_STORAGE_URL``. Both
backends implement ``Storage`` (base.py): verified streaming writes, ranged
reads, optional presigned URLs, and staged bytes for resumable upload sessions.
"""

from cgstore.storage.base import BlobWriter, Storage, StagedUpload

__all__ = ["BlobWriter", "Storage", "StagedUpload", "open_storage"]


def open_storage(settings) -> Storage:
    if settings.storage_is_s3:
        from cgstore.storage.s3 import S3Storage

        return S3Storage.from_settings(settings)
    from cgstore.storage.fs import FileStorage

    return FileStorage.from_settings(settings)
