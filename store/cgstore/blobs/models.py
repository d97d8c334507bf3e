"""Tables of the blobs feature: stored blobs, their per-repo links and who holds them, upload sessions."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, BigInteger, ForeignKey, ForeignKeyConstraint, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime, utcnow

#: ``blobs.health``: what the last check of the stored bytes found.
BLOB_OK = "ok"
BLOB_MISSING = "missing"
BLOB_CORRUPT = "corrupt"


class Blob(Base):
    """Bytes stored once globally, by digest. A row exists only after a verified write.

    Columns:
      digest      ``blake3:<64 hex>`` of the bytes; the storage key derives from it.
      size        length in bytes.
      created_at  when the bytes were first verified and stored.
      linked_at   the last time anything linked it (a repo link, a session commit, a
                  record's publish): written in that transaction, so garbage
                  collection's conditional mark of this very row sees it.
      collecting_since  set when garbage collection condemned it (its bytes may be
                  going or gone): readers treat it as absent and links refuse it.
      health      what the last check of the stored bytes found: ``ok``, ``missing`` or
                  ``corrupt`` (set by the scrub, back to ``ok`` by a verified re-upload).
      last_served_at  on a mirror, the last time a download served it (written at most once a
                  minute per blob); NULL: never since it was stored. Mirror eviction
                  (``mirror/eviction.py``) goes by it.
    """

    __tablename__ = "blobs"

    digest: Mapped[str] = mapped_column(String(71), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger, nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    linked_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    collecting_since: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    health: Mapped[str] = mapped_column(String(16), nullable=False, default=BLOB_OK, server_default=BLOB_OK)
    last_served_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)


class RepoBlob(Base):
    """A blob linked into a repo (uploaded there, or mounted from a readable repo).

    Columns:
      repo_id     the repo.
      digest      the blob.
      linked_by   principal whose upload or mount made the link.
      created_at  when the link was made.
    """

    __tablename__ = "repo_blobs"

    repo_id: Mapped[int] = mapped_column(Integer, ForeignKey("repos.id", ondelete="CASCADE"), primary_key=True)
    digest: Mapped[str] = mapped_column(String(71), ForeignKey("blobs.digest"), primary_key=True, index=True)
    linked_by: Mapped[str] = mapped_column(String(200), nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)


class RepoBlobHolder(Base):
    """A principal that linked a blob into a repo (by upload or mount): one row per principal.

    In a ``principal`` repo only the holders of a blob read it (``cgstore.access``);
    two tenants who upload the same bytes each hold their own link.

    Columns:
      repo_id     the repo.
      digest      the blob.
      principal   who uploaded or mounted it there.
      created_at  when they first did.
    """

    __tablename__ = "repo_blob_holders"
    __table_args__ = (
        ForeignKeyConstraint(["repo_id", "digest"], ["repo_blobs.repo_id", "repo_blobs.digest"], ondelete="CASCADE"),
    )

    repo_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(71), primary_key=True)
    principal: Mapped[str] = mapped_column(String(200), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)


class UploadSession(Base):
    """A resumable chunked upload in progress.

    Columns:
      id              opaque session id (in the Location URL).
      repo_id         the repo the blob will be linked into.
      principal       who opened it; only they may continue it.
      offset          bytes committed so far (the next chunk must start here).
      storage_state   backend bookkeeping for the staged bytes (JSON).
      created_at      when it was opened.
      expires_at      when it is reclaimed if untouched; pushed forward by each chunk.
    """

    __tablename__ = "upload_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    repo_id: Mapped[int] = mapped_column(Integer, ForeignKey("repos.id", ondelete="CASCADE"), nullable=False)
    principal: Mapped[str] = mapped_column(String(200), nullable=False)
    offset: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    storage_state: Mapped[dict] = mapped_column(JSON, nullable=False, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False, index=True)
