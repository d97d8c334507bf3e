"""Object storage for blob bytes: a local directory or any S3-compatible store.

``open_storage(settings)`` picks the driver from ``CGSTORE_STORAGE_URL``. Both
drivers are plain object stores (``ObjectStore`` in base.py: stream to a key
and publish it, read a range, stat, list with a cursor, delete, presign) plus
staged bytes for resumable upload sessions; ``Storage`` builds verified
streaming blob writes on them once (``writer.py``), for every driver.
"""

from cgstore.storage.base import BlobWriter, StagedUpload, Storage

__all__ = ["BlobWriter", "Storage", "StagedUpload", "open_storage"]


def open_storage(settings) -> Storage:
    if settings.storage_is_s3:
        from cgstore.storage.s3 import S3Storage

        return S3Storage.from_settings(settings)
    from cgstore.storage.fs import FileStorage

    return FileStorage.from_settings(settings)
