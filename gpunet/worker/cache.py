"""Program caches keyed by ``program_hash``: loaded programs in memory, program bytes on disk; both bounded LRU.

A repeat job then skips the transfer (disk) and the validation and weight loading (memory). The disk cache is
shared by the executor processes: writes are atomic (temp file + rename) and eviction tolerates races.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TypeVar

from gpunet.errors import JobRejected
from gpunet.protocol import PROGRAM_HASH_RE
from gpunet.utils import LRU

V = TypeVar("V")


def check_hash(program_hash: str) -> str:
    """A program hash is 64 lowercase hex digits (it becomes a file name: no path tricks)."""
    if not isinstance(program_hash, str) or not PROGRAM_HASH_RE.match(program_hash):
        raise JobRejected(f"malformed program hash {str(program_hash)[:80]!r}")
    return program_hash


#: Loaded programs: at most ``max_items`` and ``max_bytes`` in total (each program's size given on insert).
MemoryLRU = LRU


class DiskCache:
    """Program bytes as ``<dir>/<hash>.gpunet``; least recently used (by mtime) evicted beyond ``max_bytes``."""

    SUFFIX = ".gpunet"

    def __init__(self, directory: str | Path, max_bytes: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def _path(self, program_hash: str) -> Path:
        return self.dir / (check_hash(program_hash) + self.SUFFIX)

    def __contains__(self, program_hash: str) -> bool:
        try:
            return self._path(program_hash).is_file()
        except JobRejected:
            return False

    def get(self, program_hash: str) -> bytes | None:
        path = self._path(program_hash)
        try:
            data = path.read_bytes()
            os.utime(path)  # mark as recently used
        except FileNotFoundError:
            return None
        return data

    def put(self, program_hash: str, data: bytes) -> None:
        path = self._path(program_hash)
        if len(data) > self.max_bytes:
            return
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._evict(keep=path)

    def hashes(self) -> list[str]:
        return [p.name[: -len(self.SUFFIX)] for p in self.dir.glob("*" + self.SUFFIX)]

    def _evict(self, keep: Path) -> None:
        entries = []
        for p in self.dir.glob("*" + self.SUFFIX):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            if p != keep:
                p.unlink(missing_ok=True)
                total -= size
