"""The holding keys (:mod:`gpunet.protocol.holding`) of the programs in this worker's disk cache, for checking the
proofs clients and fetching peers present: computed from the cached bytes the first time a proof needs one (one pass
over the program, in a thread, read a chunk at a time), then kept. Only programs on disk have one: a private program
(never written) or one evicted since has none here, and whoever names it must send its bytes.

A stranger's made-up proofs cost the worker at most one pass per program it caches (the key is kept, right or wrong
proof alike), and nothing for hashes it does not cache."""

from __future__ import annotations

import asyncio
import hashlib

from gpunet.protocol import holding
from gpunet.utils import LRU

MAX_KEYS = 4096


class HoldingKeys:
    def __init__(self, disk, max_keys: int = MAX_KEYS):
        """``disk``: the executors' DiskCache (None: this worker caches nothing on disk, so it checks no proof)."""
        self.disk = disk
        self._keys: LRU[str, asyncio.Future] = LRU(max_keys)

    async def of(self, program_hash: str) -> bytes | None:
        """The program's holding key, or None when it is not in the disk cache."""
        if self.disk is None:
            return None
        key = self._keys.get(program_hash)
        if key is None:
            key = asyncio.ensure_future(asyncio.to_thread(self._compute, program_hash))
            self._keys.put(program_hash, key)
        try:
            found = await asyncio.shield(key)
        except Exception:
            found = None
        if found is None and self._keys.get(program_hash) is key:
            self._keys.pop(program_hash)  # cached later, it gets a key then
        return found

    def _compute(self, program_hash: str) -> bytes | None:
        hasher = self.disk.digest(program_hash, hashlib.sha256(holding.KEY_PREFIX))
        return None if hasher is None else hasher.digest()

    async def verifies(self, program_hash: str, given: bytes | None, purpose: str, verifier: str, prover: str
                       ) -> bool:
        """Whether ``given`` proves, for ``prover``, that whoever made it holds this program's bytes."""
        if given is None:
            return False
        key = await self.of(program_hash)
        return key is not None and holding.verifies(key, given, purpose, verifier, prover)
