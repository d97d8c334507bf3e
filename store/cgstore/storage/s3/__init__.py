"""The S3 driver, split by job: ``driver`` (the ``S3Storage`` class: keys, object
primitives, operations), ``multipart`` (streaming writes and their buffers),
``staging`` (resumable uploads as chunk objects joined inside S3) and ``errors``
(S3 answers mapped to the store's errors). Each module's docstring says why it
works the way it does.
"""

from cgstore.storage.s3.driver import S3Storage, parse_storage_url

__all__ = ["S3Storage", "parse_storage_url"]
