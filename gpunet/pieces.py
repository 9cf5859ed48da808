"""A program's bytes cut into pieces, each with its own hash, so a worker can fetch it from peers and catch a peer
that serves one wrong byte at that piece (BitTorrent's idea; the client that sends the job vouches for the list).

The pieces are of the container bytes (what ``program_hash`` is computed from): piece ``i`` is
``data[i * piece_size:(i + 1) * piece_size]``, its hash the sha256 of those bytes. ``piece_size`` is a power of two
from :data:`MIN_PIECE_BYTES`, chosen so a program has at most :data:`MAX_PIECES` (its hash list then fits in one
protocol frame).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

MIN_PIECE_BYTES = 4 << 20
MAX_PIECES = 1024
DIGEST = 32


def piece_size_for(size: int) -> int:
    """The piece size of a program of ``size`` bytes."""
    piece = MIN_PIECE_BYTES
    while size > piece * MAX_PIECES:
        piece *= 2
    return piece


def count(size: int, piece_size: int) -> int:
    return max(1, math.ceil(size / piece_size))


def digests(data: bytes | memoryview, piece_size: int | None = None) -> bytes:
    """The concatenated sha256 digests of ``data``'s pieces."""
    view = memoryview(data).cast("B")
    piece_size = piece_size or piece_size_for(view.nbytes)
    return b"".join(hashlib.sha256(view[i:i + piece_size]).digest()
                    for i in range(0, max(view.nbytes, 1), piece_size))


@dataclass(frozen=True)
class PieceList:
    """What a fetcher checks each piece against: the program's size, the piece size and every piece's digest."""

    size: int
    piece_size: int
    hashes: bytes

    def __post_init__(self):
        if self.piece_size != piece_size_for(self.size):
            raise ValueError(f"a {self.size}-byte program has pieces of {piece_size_for(self.size)} bytes, "
                             f"not {self.piece_size}")
        if len(self.hashes) != DIGEST * count(self.size, self.piece_size):
            raise ValueError("the piece list does not have one digest per piece")

    @classmethod
    def of(cls, data: bytes | memoryview) -> "PieceList":
        size = memoryview(data).nbytes
        return cls(size, piece_size_for(size), digests(data))

    def __len__(self) -> int:
        return len(self.hashes) // DIGEST

    def span(self, index: int) -> tuple[int, int]:
        """Start and length of piece ``index``."""
        start = index * self.piece_size
        return start, min(self.piece_size, self.size - start)

    def matches(self, index: int, data: bytes | memoryview) -> bool:
        return hashlib.sha256(data).digest() == self.hashes[index * DIGEST:(index + 1) * DIGEST]
