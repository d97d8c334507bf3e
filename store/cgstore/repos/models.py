"""The repos table."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Integer, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime, utcnow

#: A repo of per-principal private caches (the rule is ``cgstore.access``'s).
PRIVATE = "principal"
VISIBILITIES = ("owner", PRIVATE)


class Repo(Base):
    """An ``owner/repo`` namespace. Comes into being on its first write.

    Columns:
      id          surrogate key other tables link to.
      owner       owner slug (validated: ``[a-z0-9-]``, see core/names.py).
      name        repo name (validated: ``[a-z0-9._-]``).
      visibility  ``owner``: a read grant reads everything; ``principal``: a
                  reader sees only what the same principal published.
      created_by  principal whose write created it.
      created_at  creation time.
    """

    __tablename__ = "repos"
    __table_args__ = (UniqueConstraint("owner", "name", name="uq_repos_owner_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(40), nullable=False)
    name: Mapped[str] = mapped_column(String(100), nullable=False)
    visibility: Mapped[str] = mapped_column(String(16), nullable=False, default="owner")
    created_by: Mapped[str] = mapped_column(String(200), nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
