"""The table of a regional mirror's own state (``mirror/``): small named values, one row each.

Kept in the database, not on a replica's disk, so every replica of a mirror
trusts the same upstream keys and follows the feed from the same cursor.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, String
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime, utcnow

#: The upstream's keys the mirror trusts: ``{"keys": [...], "fingerprint": ..., "url": ...}`` (``mirror/trust.py``).
TRUSTED_JWKS = "trusted_jwks"
#: The upstream events feed's cursor the follower resumes from (``mirror/follower.py``).
FEED_CURSOR = "feed_cursor"
#: The last time the upstream answered, and the last failure (``mirror/service.py``).
LAST_CONTACT = "last_contact"
#: A key set the upstream served that no trusted key vouches for: refused, kept for the operator.
REFUSED_KEYS = "refused_keys"


class MirrorState(Base):
    """One named value of the mirror's state.

    Columns:
      name        what the value is (``TRUSTED_JWKS``, ``FEED_CURSOR``, ``LAST_CONTACT``, ``REFUSED_KEYS``...).
      value       the value, a JSON document.
      updated_at  when it was last written.
    """

    __tablename__ = "mirror_state"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[dict] = mapped_column(JSON, nullable=False)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
