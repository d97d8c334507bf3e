"""Digests, storage keys and the streaming verifier shared by both backends.

A digest is ``blake3:<64 lowercase hex>`` (docs/protocol.md). Both backends lay
blobs out the same way, ``blobs/<hex[:2]>/<hex>``, so a store can move from a
directory to a bucket by copying the tree. ``StreamVerifier`` is the one place
that decides whether written bytes match what the caller promised: it checks
the size as bytes arrive (so an oversized stream is refused early, before it
fills the disk) and the size then the digest at the end.
"""

from __future__ import annotations

import collections
import re
import threading
import uuid

import blake3

from cgstore.core.errors import BlobUploadUnknown, DigestInvalid, SizeInvalid, TooLarge

DIGEST_PREFIX = "blake3:"
_DIGEST_RE = re.compile(r"blake3:([0-9a-f]{64})")  # used with fullmatch: no trailing newline
# Session ids become file names and object keys: no separators, no dot-files.
_SESSION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")  # used with fullmatch

#: Chunk size of every streamed read (both backends): big enough for throughput,
#: small enough that a thousand concurrent downloads stay in a GiB.
READ_CHUNK_BYTES = 1 << 20


def parse_digest(digest: str) -> str:
    """The 64-hex part of a well-formed digest; ``DigestInvalid`` otherwise."""
    match = _DIGEST_RE.fullmatch(digest) if isinstance(digest, str) else None
    if match is None:
        raise DigestInvalid("digest must be blake3:<64 lowercase hex>", digest=str(digest)[:100])
    return match.group(1)


def blake3_digest(data: bytes) -> str:
    """The digest of bytes already in memory (small documents, tests)."""
    return DIGEST_PREFIX + blake3.blake3(data).hexdigest()


def blob_key(hex_digest: str) -> str:
    """Where a blob lives, relative to the backend's root: ``blobs/<hex[:2]>/<hex>``.

    The two-character fan-out keeps directories (and S3 listing pages) small.
    """
    return f"blobs/{hex_digest[:2]}/{hex_digest}"


def is_session_id(name: str) -> bool:
    """Whether ``name`` is safe to use as a session's file name / key segment."""
    return isinstance(name, str) and _SESSION_ID_RE.fullmatch(name) is not None


def check_session_id(session_id: str) -> str:
    """A session id safe to use as a file name / key segment; else it cannot exist."""
    if not is_session_id(session_id):
        raise BlobUploadUnknown("no such upload session", session_id=str(session_id)[:100])
    return session_id


def check_range(start: int, end: int | None) -> None:
    """Reject ranges no caller should build (the service validates HTTP ranges first)."""
    if start < 0 or (end is not None and end < start):
        raise ValueError(f"invalid byte range [{start}, {end})")


def refuse_past_limit(declared: int | None, max_bytes: int | None) -> None:
    """``TooLarge`` when a declared size passes the store's limit (before any byte is read)."""
    if declared is not None and max_bytes is not None and declared > max_bytes:
        raise TooLarge("blob exceeds the store's size limit", size=declared, limit=max_bytes)


class StreamVerifier:
    """Hashes and counts a stream, then says whether it is the promised blob.

    ``expected_size`` None means "whatever arrives"; ``max_bytes`` None means no
    limit. Errors raised here are the protocol's: ``SizeInvalid`` when more (as
    soon as it happens) or fewer (at ``verify``) bytes than promised arrived,
    ``TooLarge`` past the store's limit, ``DigestInvalid`` on a digest mismatch.
    """

    def __init__(self, digest: str, expected_size: int | None = None, max_bytes: int | None = None):
        self.digest = digest
        self.hex = parse_digest(digest)
        self.expected_size = expected_size
        self.max_bytes = max_bytes
        self.size = 0
        # Multithreaded for large updates (1 MiB reads at commit); small ones stay single-threaded.
        self._hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        if expected_size is not None and expected_size < 0:
            raise SizeInvalid("size must not be negative", expected=expected_size)
        refuse_past_limit(expected_size, max_bytes)

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        new_size = self.size + len(chunk)
        if self.expected_size is not None and new_size > self.expected_size:
            raise SizeInvalid("more bytes than the declared size", expected=self.expected_size)
        if self.max_bytes is not None and new_size > self.max_bytes:
            raise TooLarge("blob exceeds the store's size limit", limit=self.max_bytes)
        self._hasher.update(chunk)
        self.size = new_size

    @classmethod
    def resumed(cls, digest: str, state: StreamState, max_bytes: int | None = None) -> StreamVerifier:
        """A verifier that has already seen the ``state.size`` bytes ``state`` hashed (and now owns it)."""
        verifier = cls(digest, state.size, max_bytes)
        verifier._hasher, verifier.size = state.hasher, state.size
        return verifier

    def verify(self) -> None:
        """Raise unless size (checked first) and digest are the promised ones."""
        if self.expected_size is not None and self.size != self.expected_size:
            raise SizeInvalid("size differs from the declared size", expected=self.expected_size, actual=self.size)
        actual = self._hasher.hexdigest()
        if actual != self.hex:
            raise DigestInvalid(
                "content does not match the digest", expected=self.digest, actual=DIGEST_PREFIX + actual
            )


class StreamState:
    """The blake3 state of the first ``size`` bytes of a stream (what a staged upload holds)."""

    __slots__ = ("hasher", "size")

    def __init__(self, hasher: blake3.blake3 | None = None, size: int = 0) -> None:
        self.hasher = blake3.blake3() if hasher is None else hasher
        self.size = size

    def copy(self) -> StreamState:
        return StreamState(self.hasher.copy(), self.size)

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        self.hasher.update(chunk)
        self.size += len(chunk)


#: The key of a staged upload's state naming the stream hash this process kept for it.
STREAM_HASH_FIELD = "stream_hash"


class StreamHashes:
    """This process's blake3 states of staged uploads, so a commit need not read them back.

    Why: hashing a staged stream at commit means reading every byte back from
    storage; the appends saw each byte already. The state after an append is
    kept here under a fresh random token, and the token goes into the session
    state the service records (``STREAM_HASH_FIELD``). A token names the state
    of exactly one append by this process, which continued the state named by
    the token of the recorded state it appended to, so a recorded state whose
    token is found here was hashed byte for byte as it was staged. Anything
    else (another process served an append, this one restarted, the entry was
    evicted) finds no entry and the commit reads the bytes back instead:
    correctness never depends on this cache. Bounded (least recently used);
    a state is a few KiB.
    """

    def __init__(self, limit: int = 1024) -> None:
        self._limit = limit
        self._states: collections.OrderedDict[str, StreamState] = collections.OrderedDict()
        self._lock = threading.Lock()

    def resume(self, session_state: dict, offset: int) -> StreamState | None:
        """A copy of the stream state the recorded ``session_state`` names (fresh at offset 0), if kept."""
        if offset == 0:
            return StreamState()
        token = session_state.get(STREAM_HASH_FIELD)
        with self._lock:
            state = self._states.get(token) if isinstance(token, str) else None
            if state is None or state.size != offset:
                return None
            self._states.move_to_end(token)
            return state.copy()

    def keep(self, state: StreamState) -> str:
        """Keep ``state``; return the token to record with the session state."""
        token = uuid.uuid4().hex
        with self._lock:
            self._states[token] = state
            while len(self._states) > self._limit:
                self._states.popitem(last=False)
        return token
