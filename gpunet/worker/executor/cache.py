"""Program caches keyed by ``program_hash``: loaded programs in memory, program bytes on disk; both bounded LRU.

A repeat job then skips the transfer (disk) and the validation and weight loading (memory). The disk cache is
shared by the executor processes: writes are atomic (temp file + rename) and eviction tolerates races.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
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
    """Program bytes as ``<dir>/<hash>.gpunet``; least recently used (by mtime) evicted beyond ``max_bytes`` or
    ``max_files``. Bounding the count as well as the bytes bounds every directory scan (a flood of tiny programs
    cannot make one slow) and the listing the worker advertises."""

    SUFFIX = ".gpunet"
    #: Left-over temporary files (a process killed mid-write) older than this are removed at the next eviction.
    STALE_TMP_SECONDS = 3600.0

    def __init__(self, directory: str | Path, max_bytes: int, max_files: int = 1024):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_files = max_files

    def _path(self, program_hash: str) -> Path:
        return self.dir / (check_hash(program_hash) + self.SUFFIX)

    def __contains__(self, program_hash: str) -> bool:
        try:
            return self._path(program_hash).is_file()
        except JobRejected:
            return False

    def get(self, program_hash: str) -> bytes | memoryview | None:
        """The program's bytes, mapped read-only: page-aligned, so its weights are used where they lie (no copy, and
        the page cache's one copy is shared by every executor that loads it). A cached file is only ever replaced
        (put writes a new file and renames it) or removed, never changed in place, so the mapping stays what was
        checked at load."""
        path = self._path(program_hash)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = memoryview(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)) if size else b""
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

    def size(self, program_hash: str) -> int | None:
        try:
            return self._path(program_hash).stat().st_size
        except (FileNotFoundError, JobRejected):
            return None

    def read_range(self, program_hash: str, start: int, length: int) -> bytes | None:
        """``length`` bytes of a cached program from ``start`` (fewer at its end): for serving a piece to a peer."""
        try:
            path = self._path(program_hash)
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(length)
            if start == 0:
                os.utime(path)  # being served: recently used (once per fetch, not per piece)
            return data
        except (FileNotFoundError, JobRejected):
            return None

    def digest(self, program_hash: str, hasher, chunk: int = 1 << 20):
        """Feed a cached program's bytes to ``hasher`` a chunk at a time (never the whole program in memory);
        the hasher, or None when the program is not cached."""
        try:
            with open(self._path(program_hash), "rb") as f:
                while block := f.read(chunk):
                    hasher.update(block)
            return hasher
        except (FileNotFoundError, JobRejected):
            return None

    def hashes(self) -> list[str]:
        """Cached program hashes, least recently used first."""
        return [Path(path).name[: -len(self.SUFFIX)] for _, _, path in self._entries()]

    def _entries(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of each cached program, oldest first; stale temporary files are removed on the way."""
        entries = []
        now = time.time()
        with os.scandir(self.dir) as it:
            for entry in it:
                try:
                    if entry.name.endswith(self.SUFFIX):
                        st = entry.stat()
                        entries.append((st.st_mtime, st.st_size, entry.path))
                    elif entry.name.startswith(".tmp-") and now - entry.stat().st_mtime > self.STALE_TMP_SECONDS:
                        os.unlink(entry.path)
                except FileNotFoundError:  # another executor evicted it meanwhile
                    continue
        entries.sort()
        return entries

    def _evict(self, keep: Path) -> None:
        entries = self._entries()
        total, count = sum(size for _, size, _ in entries), len(entries)
        for _, size, path in entries:
            if total <= self.max_bytes and count <= self.max_files:
                break
            if path != str(keep):
                Path(path).unlink(missing_ok=True)
                total -= size
                count -= 1
