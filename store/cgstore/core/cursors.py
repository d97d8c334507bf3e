"""Opaque listing cursors: a position sealed to the one listing it pages.

A listing pages by row id (keyset), and record ids are global: handed out
plainly, a tenant's consecutive cursors showed gaps where other tenants had
published in between. So a ``next_cursor`` is the position encrypted and
authenticated (AES-256-GCM, a fresh 96-bit nonce each time) with the listing's
scope (``compiled-graphs:<repo id>``) as associated data: it says nothing
about the position, two cursors to one position differ, and a cursor presented
to another repo's listing, cut, altered, forged or made up (a bare id) does
not open: 400 ``BAD_REQUEST``.

The key is derived from the store's bootstrap signing key (``KeyRing.derive``),
which replicas share: a cursor from one replica opens on another, and cursors
survive restarts and token-key rotations.
"""

from __future__ import annotations

import base64
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cgstore.core.errors import BadRequest

_NONCE_BYTES = 12
_POSITION_BYTES = 8  # row ids are signed 64-bit on both databases
_TAG_BYTES = 16
#: The length of every cursor (unpadded base64url of nonce, position and tag).
CURSOR_LEN = len(base64.urlsafe_b64encode(bytes(_NONCE_BYTES + _POSITION_BYTES + _TAG_BYTES)).rstrip(b"="))


class CursorSeal:
    """Seals positions into cursors and opens them, for one key."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal(self, scope: str, position: int) -> str:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, position.to_bytes(_POSITION_BYTES, "big"), scope.encode())
        return base64.urlsafe_b64encode(nonce + sealed).rstrip(b"=").decode("ascii")

    def open(self, scope: str, cursor: str) -> int:
        """The position ``cursor`` holds, if this store sealed it for ``scope``; else ``BAD_REQUEST``."""
        if len(cursor) != CURSOR_LEN:
            raise _not_ours(cursor)
        try:  # binascii.Error and a non-ASCII cursor's UnicodeEncodeError are ValueErrors
            raw = base64.urlsafe_b64decode(cursor.encode("ascii") + b"=" * (-len(cursor) % 4))
            plain = self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], scope.encode())
        except (ValueError, InvalidTag):
            raise _not_ours(cursor) from None
        return int.from_bytes(plain, "big")


def _not_ours(cursor: str) -> BadRequest:
    return BadRequest("cursor is not the next_cursor of a previous page of this listing", cursor=cursor[:CURSOR_LEN])
