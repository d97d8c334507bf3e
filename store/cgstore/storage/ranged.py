"""``RangedFile``: a stored object as a seekable, read-only binary file, read by ranges on demand.

Admission reads an archive's zip structure and a few records, a small part of a
large ``.pt2`` (the compiled shared object, the bulk, is only sniffed); reading
through ranges fetches just those parts instead of spooling the whole object
first. Small reads are served from a few cached blocks (zip reading seeks to and
reads many small headers); a read of at least a block is fetched as one range.
"""

from __future__ import annotations

import io
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator

#: Bytes fetched for a small read, and how many such blocks are kept.
BLOCK_BYTES = 64 << 10
CACHED_BLOCKS = 16

ReadRange = Callable[[int, int], Iterator[bytes]]


class RangedFile(io.RawIOBase):
    """``size`` bytes read through ``read_range(start, end)``; every ``read(n)`` returns ``n``
    bytes unless the object ends first (zip readers expect whole headers from one read)."""

    def __init__(self, read_range: ReadRange, size: int, name: str = "<ranged>") -> None:
        super().__init__()
        self._read_range = read_range
        self._size = size
        self._position = 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self.name = name
        self.fetched = 0  # bytes read from storage, for the curious (tests, benches)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._position = base + offset
        return self._position

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def read(self, size: int = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._position + size)
        if end <= self._position:
            return b""
        start, self._position = self._position, end
        if end - start >= BLOCK_BYTES:
            return self._fetch(start, end)
        return b"".join(self._cached(start, end))

    def _cached(self, start: int, end: int) -> Iterator[bytes]:
        for first in range(start - start % BLOCK_BYTES, end, BLOCK_BYTES):
            block = self._block(first)
            yield block[max(start - first, 0) : end - first]

    def _block(self, first: int) -> bytes:
        block = self._blocks.get(first)
        if block is None:
            block = self._blocks[first] = self._fetch(first, min(first + BLOCK_BYTES, self._size))
            if len(self._blocks) > CACHED_BLOCKS:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(first)
        return block

    def _fetch(self, start: int, end: int) -> bytes:
        data = b"".join(self._read_range(start, end))
        if len(data) != end - start:
            raise OSError(f"a ranged read of [{start}, {end}) returned {len(data)} bytes")
        self.fetched += len(data)
        return data
