"""The key ring: the Ed25519 keys that sign and verify cap-tokens, rotated without a restart.

Public halves live in the ``signing_keys`` table, private halves on disk:

- the bootstrap key at ``settings.signing_key_path`` (PEM, PKCS8), generated
  there exactly once when absent: under a file lock, so two processes starting
  together agree on one key, and written atomically with 0600 permissions, so
  no process ever reads half a key. It joins the ring on first use.
- every key ``cgstore keys rotate`` adds, at ``settings.keys_dir/<kid>.pem``.

The newest key that is not retired (and whose private half this host holds)
signs; every key that is not retired verifies. The table is read on every mint
and every verification (a primary-key lookup, on verification within the
token's own statement), so ``rotate`` and ``retire`` reach every running
process on the next request: there is no cache to expire.
Parsed keys are cached by ``kid``, which is the SHA-256 of the public key, so a
cached key can never stand for another.

A ``kid`` is the first 16 hex digits of the SHA-256 of the raw public bytes.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from filelock import FileLock
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from cgstore.core.db import Database, insert_ignoring_conflicts, utcnow
from cgstore.core.errors import BadRequest, NameUnknown, TokenInvalid, Unavailable
from cgstore.settings import Settings
from cgstore.tokens.models import SigningKey

log = logging.getLogger(__name__)

# Generous: another process may be generating the key right now (it takes ms).
_LOCK_TIMEOUT_S = 60.0
KID_LEN = 16


#: Said with an unknown kid: the usual cause is a token minted by ``cgstore token mint`` under another
#: CGSTORE_HOME (another directory's ``.cgstore``: another database and key), which the CLI names.
UNKNOWN_KEY_HINT = (
    "; was it minted under another CGSTORE_HOME? `cgstore token mint` prints the one it used, and must use the server's"
)


#: The ``typ`` and ``aud`` of a key-set statement (``KeyRing.key_statements``): never a token's or a receipt's.
KEYSET_TYP = "cgstore-keyset+jwt"
KEYSET_AUDIENCE = "cgstore-keyset"


class KeyConfigError(RuntimeError):
    """A configured key file is unreadable or not an Ed25519 key.

    A startup failure, not a request error: the store must not run with a key
    it cannot use.
    """


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:KID_LEN]


def public_pem(public_key: Ed25519PublicKey) -> str:
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode(
        "ascii"
    )


def jwk(kid: str, public_key: Ed25519PublicKey) -> dict[str, str]:
    """The RFC 8037 JWK of an Ed25519 public key (``x`` only: never a private part)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    x = base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")
    return {"kty": "OKP", "crv": "Ed25519", "x": x, "kid": kid, "alg": "EdDSA", "use": "sig"}


@dataclass(frozen=True)
class KeyInfo:
    """One key of the ring as ``cgstore keys list`` shows it."""

    kid: str
    created_at: object
    retired_at: object
    signs_here: bool


@dataclass(frozen=True)
class KeyRow:
    """The columns of a ``signing_keys`` row that verification reads."""

    kid: str
    public_key: str
    retired_at: object


class KeyRing:
    """Signing and verification keys, read from the database on every use."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self._db = db
        self._keys_dir = Path(settings.keys_dir)
        bootstrap = load_or_create_signing_key(settings.signing_key_path)
        self.bootstrap_kid = key_id(bootstrap.public_key())
        self._private: dict[str, Ed25519PrivateKey] = {self.bootstrap_kid: bootstrap}
        self._public: dict[str, Ed25519PublicKey] = {}
        self._enrolled = False
        self._lock = threading.Lock()

    # -- the two questions every request asks ---------------------------------------

    def signing_key(self, session: Session) -> tuple[str, Ed25519PrivateKey]:
        """The newest key that is not retired and whose private half is on this host.

        The live keys' rows are read ``FOR SHARE`` (PostgreSQL; SQLite serializes
        writers instead): ``retire`` cannot commit until the caller's transaction
        has, so what it signs is either committed before the retirement (and seen
        by the re-signing in its transaction) or signed by another key.
        """
        self._ensure_enrolled()
        kids = session.scalars(
            select(SigningKey.kid)
            .where(SigningKey.retired_at.is_(None))
            .order_by(SigningKey.created_at.desc(), SigningKey.kid.desc())
            .with_for_update(read=True)
        )
        for kid in kids:
            private = self._private_key(kid)
            if private is not None:
                return kid, private
        raise Unavailable("no signing key is available on this host: every key is retired or elsewhere")

    def verify_key(self, kid: str, row: KeyRow | None) -> Ed25519PublicKey:
        """The public key ``kid`` names, given its row as just read (None: no such row); else ``TokenInvalid``.

        The caller reads the row on every verification (``TokenService.verify``
        does it in the same statement as the token's record), so a retirement
        counts from the next request; only the parsed key is cached.
        """
        self._ensure_enrolled()
        if row is None:
            raise TokenInvalid(f"token signed by an unknown key (kid {kid!r}){UNKNOWN_KEY_HINT}")
        if row.retired_at is not None:
            raise TokenInvalid(f"token signed by a retired key (kid {kid!r})")
        return self._public_key(row)

    # -- the ring's life ----------------------------------------------------------------

    def derive(self, purpose: str) -> bytes:
        """A 256-bit key for ``purpose`` (HKDF-SHA256 of the bootstrap key): the same on every replica
        sharing ``CGSTORE_TOKEN_SIGNING_KEY``, unrelated to any other purpose's, revealing nothing of the key."""
        raw = self._private[self.bootstrap_kid].private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return HKDF(hashes.SHA256(), length=32, salt=None, info=f"cgstore/{purpose}".encode()).derive(raw)

    def rotate(self, session: Session) -> str:
        """Add a new key (it signs from now on); the old ones keep verifying. Returns its kid."""
        self._ensure_enrolled()
        key = Ed25519PrivateKey.generate()
        kid = key_id(key.public_key())
        # The private half first: a row is never visible without its key on disk.
        write_private_key(self._keys_dir / f"{kid}.pem", key)
        session.add(SigningKey(kid=kid, public_key=public_pem(key.public_key()), created_at=utcnow()))
        with self._lock:
            self._private[kid] = key
        return kid

    def retire(self, session: Session, kid: str) -> bool:
        """Stop accepting ``kid``; its tokens answer 401 from the next request. False if already retired.

        Refused when no other key this host can sign with would remain: rotate first.
        The write comes first: it takes the key's row lock (PostgreSQL waits for
        every transaction signing with it, ``signing_key``) and SQLite's write
        lock, so once it returns no uncommitted signature by ``kid`` remains.
        """
        self._ensure_enrolled()
        if not isinstance(kid, str):
            raise NameUnknown(f"no signing key with kid {kid!r}")
        retired = session.execute(
            update(SigningKey)
            .where(SigningKey.kid == kid, SigningKey.retired_at.is_(None))
            .values(retired_at=utcnow())
            .returning(SigningKey.kid)
        ).first()
        if retired is None:
            if session.get(SigningKey, kid) is None:
                raise NameUnknown(f"no signing key with kid {kid!r}")
            return False
        others = session.scalars(
            select(SigningKey.kid).where(SigningKey.retired_at.is_(None), SigningKey.kid != kid)
        ).all()
        if not any(self._private_key(other) is not None for other in others):
            raise BadRequest(f"retiring {kid} would leave no key to sign with: run `cgstore keys rotate` first")
        return True

    def list_keys(self, session: Session) -> list[KeyInfo]:
        self._ensure_enrolled()
        rows = session.scalars(select(SigningKey).order_by(SigningKey.created_at, SigningKey.kid)).all()
        return [KeyInfo(r.kid, r.created_at, r.retired_at, self._private_key(r.kid) is not None) for r in rows]

    def jwks(self, session: Session) -> list[dict[str, str]]:
        """The public keys that verify now, as JWKs (``GET /v1/keys``)."""
        self._ensure_enrolled()
        rows = session.scalars(
            select(SigningKey).where(SigningKey.retired_at.is_(None)).order_by(SigningKey.created_at, SigningKey.kid)
        ).all()
        return [jwk(row.kid, self._public_key(row)) for row in rows]

    def key_statements(self, session: Session, issuer: str, now: int) -> list[str]:
        """The JWKS that verifies now (``jwks``), signed by each of its keys whose private half is on this host
        (``GET /v1/keys:statements``): a key rotated in is announced under the keys that verified before it,
        which is how a mirror that trusts those follows the rotation (``mirror/trust.py``). Header ``typ``
        ``KEYSET_TYP`` (never a token's or a receipt's), claims ``iss``, ``aud`` ``KEYSET_AUDIENCE``, ``iat``, ``keys``."""
        import jwt

        keys = self.jwks(session)
        claims = {"iss": issuer, "aud": KEYSET_AUDIENCE, "iat": now, "keys": keys}
        statements = []
        for key in keys:
            private = self._private_key(key["kid"])
            if private is not None:
                headers = {"kid": key["kid"], "typ": KEYSET_TYP}
                statements.append(jwt.encode(claims, private, algorithm="EdDSA", headers=headers))
        return statements

    # -- internals ------------------------------------------------------------------------

    def _ensure_enrolled(self) -> None:
        """Put the bootstrap key in the ring once per process (a no-op when it is there, even retired)."""
        if self._enrolled:
            return
        with self._db.session() as session:
            insert_ignoring_conflicts(
                session,
                SigningKey,
                kid=self.bootstrap_kid,
                public_key=public_pem(self._private[self.bootstrap_kid].public_key()),
                created_at=utcnow(),
            )
        self._enrolled = True

    def _private_key(self, kid: str) -> Ed25519PrivateKey | None:
        with self._lock:
            if kid in self._private:
                return self._private[kid]
        path = self._keys_dir / f"{kid}.pem"
        if not path.exists():
            return None  # rotated on another host, whose key file was not copied here
        key = _load_private_key(path)
        if key_id(key.public_key()) != kid:
            raise KeyConfigError(f"{path} holds the key {key_id(key.public_key())}, not {kid}")
        with self._lock:
            self._private[kid] = key
        return key

    def _public_key(self, row: SigningKey | KeyRow) -> Ed25519PublicKey:
        with self._lock:
            cached = self._public.get(row.kid)
        if cached is not None:
            return cached
        key = serialization.load_pem_public_key(row.public_key.encode("ascii"))
        # A row edited to put another key under this kid must not verify anything.
        if not isinstance(key, Ed25519PublicKey) or key_id(key) != row.kid:
            raise TokenInvalid(f"key {row.kid!r} in the ring does not match its kid")
        with self._lock:
            self._public[row.kid] = key
        return key


def load_or_create_signing_key(path: Path) -> Ed25519PrivateKey:
    """Load the signing key at ``path``, generating it there first if absent."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path.with_name(path.name + ".lock")), timeout=_LOCK_TIMEOUT_S):
            # Re-check under the lock: the process that held it may have written the key.
            if not path.exists():
                write_private_key(path, Ed25519PrivateKey.generate())
    return _load_private_key(path)


def write_private_key(path: Path, key: Ed25519PrivateKey) -> None:
    """Write ``key`` to ``path`` atomically, 0600, in a 0700 directory created if needed."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
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
    log.info("wrote token signing key %s (kid %s)", path, key_id(key.public_key()))


def _load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyConfigError(f"cannot read key file {path}: {exc.strerror or exc}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyConfigError(f"{path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyConfigError(f"{path}: holds a {type(key).__name__}, not an Ed25519 private key")
    if path.stat().st_mode & 0o077:
        log.warning("token signing key %s is readable by group or others; chmod 600 it", path)
    return key


def _fsync_dir(directory: Path) -> None:
    # Makes the rename durable; not every filesystem allows opening a directory.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
