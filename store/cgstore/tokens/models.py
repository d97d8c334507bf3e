"""Tables of the tokens feature: principals and the cap-tokens minted for them."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, Boolean, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime, utcnow


class Principal(Base):
    """A named identity tokens are minted for.

    Columns:
      name        the token ``sub``; unique, case-sensitive as given.
      platform    registered as a platform principal: with a ``plt`` token and a
                  matching grant it may write under the reserved ``root/*``.
      created_at  when the principal was first registered.
    """

    __tablename__ = "principals"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    platform: Mapped[bool] = mapped_column(Boolean, default=False, nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)


class TokenRecord(Base):
    """One minted cap-token (the signed JWT is not stored, only its claims).

    Columns:
      jti          the token id (``jti`` claim).
      sub          the principal it speaks for.
      parent_jti   the token it was attenuated from, if any; revoking a parent
                   revokes its descendants.
      platform     the ``plt`` claim.
      grants       the ``grants`` claim: ``[{"repo": "<owner>/<glob>", "actions": [...]}]``.
      issued_at    ``iat``.
      expires_at   ``exp``.
      revoked_at   when it was revoked; NULL while valid.
    """

    __tablename__ = "tokens"

    jti: Mapped[str] = mapped_column(String(64), primary_key=True)
    sub: Mapped[str] = mapped_column(String(200), nullable=False, index=True)
    parent_jti: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("tokens.jti"), nullable=True, index=True
    )
    platform: Mapped[bool] = mapped_column(Boolean, default=False, nullable=False)
    grants: Mapped[list] = mapped_column(JSON, nullable=False)
    issued_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
