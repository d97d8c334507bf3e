"""The invariant checker: what must hold after any fault, whatever was interrupted.

1. Every blob row names bytes that are in storage, with that size and digest
   (a row is written only after a verified write; a crash must not leave a row
   for bytes that never arrived or arrived short).
2. Every repo link names a blob row (nothing visible points at nothing).

``violations(settings)`` reads the database and storage behind the store's
back — the way an auditor would — and names each broken rule by digest.
The fault suite asserts it returns ``[]``; its own test plants a loss and
asserts it does not.
"""

from __future__ import annotations

import blake3
from sqlalchemy import select

from cgstore.blobs.models import Blob, RepoBlob
from cgstore.core.db import Database
from cgstore.settings import Settings
from cgstore.storage import open_storage


def violations(settings: Settings) -> list[str]:
    db = Database(settings.resolved_database_url)
    storage = open_storage(settings)
    try:
        with db.session() as session:
            blobs = {row.digest: row.size for row in session.scalars(select(Blob))}
            links = [(link.repo_id, link.digest) for link in session.scalars(select(RepoBlob))]
    finally:
        db.dispose()
    found = [problem for digest, size in blobs.items() if (problem := _blob_problem(storage, digest, size))]
    found += [f"link {repo_id}->{digest}: no blob row" for repo_id, digest in links if digest not in blobs]
    return found


def _blob_problem(storage, digest: str, size: int) -> str | None:
    stored = storage.size(digest)
    if stored is None:
        return f"{digest}: missing from storage"
    if stored != size:
        return f"{digest}: {stored} bytes stored, {size} recorded"
    hasher = blake3.blake3()
    for chunk in storage.read(digest, 0, size):
        hasher.update(chunk)
    if f"blake3:{hasher.hexdigest()}" != digest:
        return f"{digest}: stored bytes hash to another digest"
    return None
