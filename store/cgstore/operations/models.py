"""Tables of the operations feature: the leases background tasks run under."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import BigInteger, String
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime


class Lease(Base):
    """A named, expiring claim: while it is held, only its holder runs the task of that name.

    Taken and renewed with one conditional UPDATE (or INSERT when the row is new),
    which both PostgreSQL and SQLite make atomic; a holder that dies stops
    renewing and its lease expires, so another replica takes over.

    Columns:
      name         the task: ``upload-reaper``, ``gc``, ...
      holder       the store instance holding it (``host:pid:random``).
      expires_at   when the claim lapses unless renewed.
      acquired_at  when the current holder took it.
      generation   incremented on every change of holder (a fencing token for logs and tests).
      cursor       where the task got to, so a successor resumes there (NULL: start afresh).
    """

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200), nullable=False)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    acquired_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    generation: Mapped[int] = mapped_column(BigInteger, nullable=False, default=1)
    cursor: Mapped[str | None] = mapped_column(String(200), nullable=True)
