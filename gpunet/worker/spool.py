"""Big payloads in files, not the worker's heap: a job's inputs (:class:`Spooled`, written as they stream in) and a
program (issue 40: a 1-2 GB program held about 2.4 copies in a worker's memory while it was fetched, served on and
handed to an executor).

:class:`SpooledProgram` is an unlinked file of the worker's spool directory, mapped shared: bytes-like to everything
that reads a program (hashing, serving pieces to other workers, parsing its manifest), written piece by piece as the
pieces come, and handed to the executor as the file's descriptor, which the executor maps in its turn. Its pages are
the page cache's: one copy for the worker and its executor, written back to disk and dropped under memory pressure
rather than pinned in anonymous memory, and gone with the last mapping (nothing is left after a crash)."""

from __future__ import annotations

import logging
import mmap
import os
import tempfile

logger = logging.getLogger(__name__)

#: Inputs and programs at least this big are spooled (when the worker has a spool directory); smaller ones stay in
#: memory, where a file's (and a mapping's) costs would outweigh what they save.
SPOOL_BYTES = 32 * 2**20


class Spooled:
    """A payload in an unlinked temporary file: its size, and its descriptor for the executor to map."""

    def __init__(self, file, size: int):
        self.file, self.size = file, size

    def __len__(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.file.close()


class SpooledProgram(mmap.mmap):
    """``size`` bytes (zeros until written) in an unlinked file of ``directory``, mapped read-write."""

    def __new__(cls, size: int, directory: str):
        file = tempfile.TemporaryFile(dir=directory)
        try:
            # Blocks reserved now, not a sparse file: a write to a mapped page the disk has no room for would kill the
            # worker with SIGBUS; here a full disk is an OSError, and the program is assembled in memory instead.
            os.posix_fallocate(file.fileno(), 0, size)
            self = super().__new__(cls, file.fileno(), size, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            file.close()
            raise
        self.file = file
        return self

    def fileno(self) -> int:
        """The file's descriptor (passed to the executor, which maps the same pages)."""
        return self.file.fileno()


def program_buffer(size: int, directory: str | None) -> "bytearray | SpooledProgram":
    """Where a program of ``size`` bytes is assembled as it comes: a spooled file when it is big and the worker has a
    spool ``directory``, else memory."""
    if directory is not None and size >= SPOOL_BYTES:
        try:
            return SpooledProgram(size, directory)
        except OSError as e:  # no room on the disk (or no spool directory any more): memory, as before
            logger.warning("Could not spool a program of %d bytes to %s (%s); assembling it in memory", size,
                           directory, e)
    return bytearray(size)
