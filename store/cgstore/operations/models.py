"""Tables of the operations feature: where an interrupted scrub resumes."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime, utcnow


class ScrubCursor(Base):
    """How far the last scrub of a scope got (blobs are walked in digest order).

    Columns:
      scope       ``*`` (every blob) or ``owner/repo`` (the blobs linked there).
      cursor      the last digest checked; NULL once a pass completed (the next starts afresh).
      updated_at  when the cursor last moved.
    """

    __tablename__ = "scrub_cursors"

    scope: Mapped[str] = mapped_column(String(300), primary_key=True)
    cursor: Mapped[str | None] = mapped_column(String(71), nullable=True)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
