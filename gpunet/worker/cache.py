"""Program caches keyed by ``program_hash``: loaded programs in memory, program bytes on disk; both bounded LRU.

A repeat job then skips the transfer (disk) and the validation and weight loading (memory). The disk cache is
shared by the executor processes: writes are atomic (temp file + rename) and eviction tolerates races.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Generic, TypeVar

from gpunet.errors import JobRejected

PROGRAM_HASH_RE = re.compile(r"[0-9a-f]{64}\Z")
V = TypeVar("V")


def check_hash(program_hash: str) -> str:
    """A program hash is 64 lowercase hex digits (it becomes a file name: no path tricks)."""
    if not isinstance(program_hash, str) or not PROGRAM_HASH_RE.match(program_hash):
        raise JobRejected(f"malformed program hash {str(program_hash)[:80]!r}")
    return program_hash


class MemoryLRU(Generic[V]):
    """At most ``max_items`` values and ``max_bytes`` in total (each value's size given on insert)."""

    def __init__(self, max_items: int, max_bytes: int):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self._bytes = 0

    def get(self, key: str) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, value: V, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            return  # larger than the whole cache: keep nothing rather than evict everything
        self.pop(key)
        self._items[key] = (value, nbytes)
        self._bytes += nbytes
        while len(self._items) > self.max_items or self._bytes > self.max_bytes:
            _, (_, n) = self._items.popitem(last=False)
            self._bytes -= n

    def pop(self, key: str) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._bytes -= item[1]

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def keys(self) -> list[str]:
        return list(self._items)


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
