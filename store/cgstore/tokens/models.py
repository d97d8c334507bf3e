"""Tables of the tokens feature: the cap-tokens minted, and the key ring that signs them."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import JSON, Boolean, ForeignKey, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from cgstore.core.db import Base, UTCDateTime, utcnow


class TokenRecord(Base):
    """One minted cap-token (the signed JWT is never stored, only its claims).

    Columns:
      jti            the token id (``jti`` claim).
      sub            the principal it speaks for.
      parent_jti     the token it was attenuated from, if any; revoking a parent
                     revokes its descendants.
      platform       the ``plt`` claim.
      grants         the ``grants`` claim: ``[{"repo": "<owner>/<glob>", "actions": [...]}]``.
      issued_at      ``iat``.
      expires_at     ``exp``.
      revoked_at     when it was revoked; NULL while valid.
      claims_digest  SHA-256 (hex) of the canonical JSON of every claim as signed:
                     a token whose claims differ (the same jti re-signed with other
                     grants, ``plt`` or ``exp`` by any accepted key) is refused.
                     NULL only for tokens minted before revision 0002, which are refused.
      kid            the key that signed it; the same claims under another kid are refused.
    """

    __tablename__ = "tokens"

    jti: Mapped[str] = mapped_column(String(64), primary_key=True)
    sub: Mapped[str] = mapped_column(String(200), nullable=False, index=True)
    parent_jti: Mapped[str | None] = mapped_column(String(64), ForeignKey("tokens.jti"), nullable=True, index=True)
    platform: Mapped[bool] = mapped_column(Boolean, default=False, nullable=False)
    grants: Mapped[list] = mapped_column(JSON, nullable=False)
    issued_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
    claims_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    kid: Mapped[str | None] = mapped_column(String(16), nullable=True)


class SigningKey(Base):
    """One Ed25519 key of the ring. Only the public half is stored here.

    The private half lives on disk (``CGSTORE_TOKEN_KEYS_DIR/<kid>.pem``, 0600,
    or the bootstrap ``CGSTORE_TOKEN_SIGNING_KEY``). The newest key that is not
    retired signs; every key that is not retired verifies. Every request reads
    this table, so a rotation or retirement reaches a running store at once.

    Columns:
      kid         first 16 hex digits of the SHA-256 of the raw public key; the JWT ``kid``.
      public_key  the public key, PEM (SubjectPublicKeyInfo).
      created_at  when it joined the ring; the newest non-retired key signs.
      retired_at  when ``cgstore keys retire`` removed it; its tokens answer 401 from then on.
    """

    __tablename__ = "signing_keys"

    kid: Mapped[str] = mapped_column(String(16), primary_key=True)
    public_key: Mapped[str] = mapped_column(Text, nullable=False)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, nullable=False)
    retired_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime, nullable=True)
