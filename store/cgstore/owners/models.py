"""Tables of the owners feature: principals and the owner slugs they hold."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Boolean, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime, utcnow


class Principal(Base):
    """A named identity tokens are minted for: a platform principal or a tenant.

    Columns:
      name        the token ``sub``; unique, case-sensitive as given.
      platform    registered as a platform principal: with a ``plt`` token and a
                  grant naming the owner literally it may write under the
                  reserved owners (``root/*`` ...). False: a tenant.
      created_at  when the principal was first registered.
    """

    __tablename__ = "principals"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    platform: Mapped[bool] = mapped_column(Boolean, default=False, nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)


class Owner(Base):
    """An owner slug claimed by a principal with ``POST /v1/owners``.

    Reserved slugs (``root``, ``admin``, ``platform``, ``system``, ``api``) are
    never rows here: nobody holds them, the root gate guards them.

    Columns:
      slug        the owner name (``[a-z0-9-]``, core/names.py), never normalized.
      principal   the principal holding it; a wildcard write grant reaches only
                  the owners its principal holds.
      created_at  when it was claimed.
    """

    __tablename__ = "owners"

    slug: Mapped[str] = mapped_column(String(40), primary_key=True)
    principal: Mapped[str] = mapped_column(String(200), ForeignKey("principals.name"), nullable=False, index=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
