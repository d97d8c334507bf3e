"""The invariant checker: what must hold after any fault, whatever was interrupted.

1. Every blob row names bytes that are in storage, with that size and digest
   (a row is written only after a verified write; a crash must not leave a row
   for bytes that never arrived or arrived short). Rows that garbage
   collection has condemned are exempt — they read as absent, and a crashed
   collection may have deleted their bytes already — but no live record may
   name one (rule 3).
2. Every repo link names a blob row (nothing visible points at nothing).
3. Every live compiled-graph record names an artifact and components that are
   uncondemned blob rows linked into the record's repo — so by rule 1, bytes
   that are stored whole.

``violations(settings)`` reads the database and storage behind the store's
back — the way an auditor would — and names each broken rule by digest.
The fault suite asserts it returns ``[]``; its own test plants a loss and
asserts it does not.
"""

from __future__ import annotations

import blake3
from sqlalchemy import select

from cgstore.blobs.models import Blob, RepoBlob
from cgstore.compiled_graphs.models import CompiledGraph, CompiledGraphComponent
from cgstore.core.db import Database
from cgstore.settings import Settings
from cgstore.storage import open_storage


def violations(settings: Settings) -> list[str]:
    db = Database(settings.resolved_database_url)
    storage = open_storage(settings)
    try:
        with db.session() as session:
            blobs = {
                row.digest: row.size for row in session.scalars(select(Blob).where(Blob.collecting_since.is_(None)))
            }
            condemned = set(session.scalars(select(Blob.digest).where(Blob.collecting_since.is_not(None))))
            links = {(link.repo_id, link.digest) for link in session.scalars(select(RepoBlob))}
            records = _live_record_blobs(session)
    finally:
        db.dispose()
    found = [problem for digest, size in blobs.items() if (problem := _blob_problem(storage, digest, size))]
    found += [
        f"link {repo_id}->{digest}: no blob row"
        for repo_id, digest in links
        if digest not in blobs and digest not in condemned
    ]
    found += [
        f"record {key}: {digest} is not a blob of its repo"
        for key, repo_id, digest in records
        if digest not in blobs or (repo_id, digest) not in links
    ]
    return found


def _live_record_blobs(session) -> list[tuple[str, int, str]]:
    """(key, repo id, digest) for the artifact and every component of each live record."""
    live = {row.id: row for row in session.scalars(select(CompiledGraph).where(CompiledGraph.yanked_at.is_(None)))}
    named = [(row.key, row.repo_id, row.artifact_digest) for row in live.values()]
    for component in session.scalars(select(CompiledGraphComponent)):
        record = live.get(component.record_id)
        if record is not None:
            named.append((record.key, record.repo_id, component.digest))
    return named


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
