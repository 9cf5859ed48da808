"""Programs on their way in: each crosses the link once, however many jobs for it arrive meanwhile.

When several jobs for a program the worker lacks arrive together, the first asks its client for the program; the
others wait for that copy (and keep using it while the executor loads it) instead of each asking for one more.
Nothing is trusted blindly: before a copy serves a job other than the one it came with, its content hash is checked
(once, in a thread), so one client cannot poison another's jobs with bytes that do not match the hash. A copy that
fails (its client hung up, it does not match, nothing more of it came for ``SHARED_WAIT``) leaves each waiting job to
ask its own client, as if no copy had been on its way. A copy still growing is waited for however long it takes: on a
slow link a program takes minutes, and each job that gave up on it cost a copy more of the link and of memory.
"""

from __future__ import annotations

import asyncio

from gpunet.errors import GpunetError
from gpunet.job.format import ProgramParts

#: How long a job waits for another job's copy of its program while nothing more of it comes, before asking its
#: own client for one (checked every SHARED_CHECK).
SHARED_WAIT = 60.0
SHARED_CHECK = 1.0


def content_hash(data: bytes) -> str | None:
    """The program hash of container bytes, or None if they are not a valid container."""
    try:
        return ProgramParts.from_bytes(data, max_bytes=len(data)).hash
    except GpunetError:
        return None


class Upload:
    """One program's bytes coming in with one job (then kept while that job's executor loads them)."""

    def __init__(self, program_hash: str, client_id: str = "", private: bool = False):
        self.program_hash = program_hash
        self.client_id = client_id  # who is sending it (a private program's copy serves only its sender's jobs)
        self.private = private
        self._bytes: asyncio.Future = asyncio.get_running_loop().create_future()
        self._checked: asyncio.Future | None = None
        # Served to other workers while it comes (gpunet.worker.peers): its size once declared, what has arrived so
        # far (``source.piece``), and the client's upload token that grants to fetch it are made with.
        self.size: int | None = None
        self.source = None
        self.token: bytes | None = None
        # Coming from its client itself (not from peers): while it comes, each piece is sent to one fetcher only
        # (``sent``: piece -> when), and the fetchers hand it on (gpunet.protocol.Have.sent).
        self.seeding = False
        self.sent: dict[int, float] = {}

    def receiving(self, size: int, source, token: bytes | None, seeding: bool = False) -> None:
        """Its bytes start to come, from ``source`` (``piece(start, length)``: those bytes once here, else None);
        ``seeding``: from its client itself."""
        self.size, self.source, self.seeding = size, source, seeding
        self.sent = {}
        if token is not None:
            self.token = token

    def piece(self, start: int, length: int) -> bytes | None:
        """Bytes ``start`` to ``start + length`` (fewer at its end) if they are here; None if not yet."""
        if self._bytes.done():
            data = self._bytes.result()
            return bytes(data[start:start + length]) if data is not None else None
        return self.source.piece(start, length) if self.source is not None else None

    def met(self, peer_id: str) -> None:
        """A peer granted pieces of this copy by its client fetches it too: told to the fetch it comes from, if any
        (gpunet.worker.peers._Fetch.met)."""
        if not self._bytes.done() and hasattr(self.source, "met"):
            self.source.met(peer_id)

    def have(self, piece_size: int) -> set[int]:
        """The indices of the pieces (of ``piece_size``) that are here."""
        if self._bytes.done():
            data = self._bytes.result()
            return set(range(-(-len(data) // piece_size))) if data is not None else set()
        return self.source.have(piece_size) if self.source is not None else set()

    async def proven(self) -> bool:
        """Its bytes are all here and hash to the program (checked once, in a thread)."""
        if not self._bytes.done() or self._bytes.result() is None:
            return False
        if self._checked is None:
            self._checked = asyncio.ensure_future(asyncio.to_thread(content_hash, self._bytes.result()))
        return await asyncio.shield(self._checked) == self.program_hash

    def arrived(self, data: bytes) -> None:
        if not self._bytes.done():
            self._bytes.set_result(data)

    def failed(self) -> None:
        if not self._bytes.done():
            self._bytes.set_result(None)

    def here(self) -> int:
        """Bytes of it here so far."""
        if self._bytes.done():
            data = self._bytes.result()
            return len(data) if data is not None else 0
        return self.source.here() if self.source is not None else 0

    async def share(self, timeout: float = SHARED_WAIT, limit: float | None = None) -> bytes | None:
        """The bytes, once here and checked against the hash; None if this copy failed, nothing more of it came for
        ``timeout`` seconds, or ``limit`` seconds passed (the waiting job's own time)."""
        loop = asyncio.get_running_loop()
        here, grew = self.here(), loop.time()
        end = loop.time() + limit if limit is not None else float("inf")
        while not self._bytes.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._bytes), min(SHARED_CHECK, timeout))
            except TimeoutError:
                now = self.here()
                if now != here:  # grew, or started over from another source (the client's, after peers failed)
                    here, grew = now, loop.time()
                elif loop.time() - grew >= timeout:
                    return None
                if loop.time() >= end:
                    return None
        data = self._bytes.result()
        if data is None:
            return None
        if self._checked is None:
            self._checked = asyncio.ensure_future(asyncio.to_thread(content_hash, data))
        return data if await asyncio.shield(self._checked) == self.program_hash else None


class Uploads:
    """The programs this worker is receiving or loading, by hash."""

    def __init__(self):
        self._coming: dict[str, Upload] = {}

    def __len__(self) -> int:
        return len(self._coming)

    def coming(self, program_hash: str) -> Upload | None:
        """The copy of this program on its way in (or being loaded) with another job, if any."""
        return self._coming.get(program_hash)

    def begin(self, program_hash: str, client_id: str = "", private: bool = False) -> Upload:
        """This job brings the program: jobs for it that come meanwhile wait for this copy."""
        upload = self._coming[program_hash] = Upload(program_hash, client_id, private)
        return upload

    def end(self, upload: Upload) -> None:
        """The job that brought it is done (the program is cached now, or it never will be from this copy)."""
        upload.failed()  # waiters still waiting for bytes that never came: ask your own client
        if self._coming.get(upload.program_hash) is upload:
            del self._coming[upload.program_hash]
