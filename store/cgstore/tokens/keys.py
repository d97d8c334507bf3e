"""The Ed25519 keys that sign and verify cap-tokens.

The signing key lives at ``settings.signing_key_path`` (PEM, PKCS8). When it is
absent it is generated there exactly once: under a file lock, so two server
processes starting together agree on one key, and written atomically with
0600 permissions, so no process ever reads half a key.

Verification accepts the signing key's public key plus every PEM listed in
``settings.token_verify_keys`` (public or private; for key rotation). Each key
is known by a ``kid``: the first 16 hex digits of the SHA-256 of its raw public
bytes. Tokens carry the ``kid`` in their header, which selects the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from filelock import FileLock

from cgstore.settings import Settings

log = logging.getLogger(__name__)

# Generous: another process may be generating the key right now (it takes ms).
_LOCK_TIMEOUT_S = 60.0


class KeyConfigError(RuntimeError):
    """A configured key file is missing, unreadable, or not an Ed25519 key.

    A startup failure, not a request error: the store must not run with a key
    it cannot use.
    """


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class KeyRing:
    """The signing key and every key a token may be verified with, by kid."""

    signing_key: Ed25519PrivateKey
    signing_kid: str
    verify_keys: dict[str, Ed25519PublicKey] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        signing_key = load_or_create_signing_key(settings.signing_key_path)
        public = signing_key.public_key()
        verify_keys = {key_id(public): public}
        for path in settings.token_verify_keys:
            extra = load_verify_key(Path(path))
            verify_keys.setdefault(key_id(extra), extra)
        return cls(signing_key=signing_key, signing_kid=key_id(public), verify_keys=verify_keys)


def load_or_create_signing_key(path: Path) -> Ed25519PrivateKey:
    """Load the signing key at ``path``, generating it there first if absent."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path.with_name(path.name + ".lock")), timeout=_LOCK_TIMEOUT_S):
            # Re-check under the lock: the process that held it may have written the key.
            if not path.exists():
                _write_new_key(path)
    return _load_private_key(path)


def load_verify_key(path: Path) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM file holding either the public or the private key."""
    data = _read(path)
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        try:
            key = serialization.load_pem_private_key(data, password=None).public_key()
        except (ValueError, TypeError) as exc:
            raise KeyConfigError(f"{path}: not a PEM public or unencrypted private key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyConfigError(f"{path}: holds a {type(key).__name__}, not an Ed25519 key")
    return key


def _write_new_key(path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask says
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)  # readers see no key or the whole key, never a prefix
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    log.info("generated token signing key %s (kid %s)", path, key_id(key.public_key()))


def _load_private_key(path: Path) -> Ed25519PrivateKey:
    data = _read(path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyConfigError(f"{path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyConfigError(f"{path}: holds a {type(key).__name__}, not an Ed25519 private key")
    if path.stat().st_mode & 0o077:
        log.warning("token signing key %s is readable by group or others; chmod 600 it", path)
    return key


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KeyConfigError(f"cannot read key file {path}: {exc.strerror or exc}") from None


def _fsync_dir(directory: Path) -> None:
    # Makes the rename durable; not every filesystem allows opening a directory.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
