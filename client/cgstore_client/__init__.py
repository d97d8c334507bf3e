"""cgstore client: the contract every worker and the store share, and the worker's client.

``Client`` (boot-time resolve or discovery, verified download into a shared cache, publish)
and its error types are exported here. ``keys`` (ck1 derivation), ``archive``
(static .pt2 reader), ``metadata`` (compiled-graph metadata schema), ``lanes``
(kernel-lane rules) need no network and no torch; ``mint`` (packaging a
compiled graph) and ``loader`` (binding constants by name) need the ``torch``
extra and are never imported from here.
"""

from cgstore_client.errors import (
    CgstoreError,
    CompiledRequired,
    Conflict,
    Denied,
    InsufficientSpace,
    IntegrityError,
    NotFound,
    Offline,
    Refused,
    StoreError,
    Unauthorized,
    Unavailable,
)
from cgstore_client.worker.client import Client, Published
from cgstore_client.worker.discovery import Booted
from cgstore_client.worker.outcomes import Eager, Loaded, Want

__version__ = "0.1.0"

__all__ = [
    "Booted",
    "CgstoreError",
    "Client",
    "CompiledRequired",
    "Conflict",
    "Denied",
    "Eager",
    "InsufficientSpace",
    "IntegrityError",
    "Loaded",
    "NotFound",
    "Offline",
    "Published",
    "Refused",
    "StoreError",
    "Unauthorized",
    "Unavailable",
    "Want",
]
