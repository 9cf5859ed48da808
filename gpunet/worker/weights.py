"""Weights that programs name by reference (docs/weights.md): where this worker finds them, and what it asks for.

A program may name weight tensors by the sha256 of their bytes instead of carrying them
(:class:`gpunet.job.format.WeightRef`). Before such a program runs, each named tensor is found, in order:

1. in the volunteer's own checkpoints (``gpunet worker --models-dir DIR``, indexed by content at start:
   :class:`gpunet.job.checkpoints.CheckpointIndex`): public files the volunteer chose to serve, so any client's
   program may name them;
2. in this worker's tensor store, if this client sent those bytes here before (a hash is no capability: a client
   names a tensor another client sent only by sending it too);
3. from the client, over the job's stream (``Send(tensors=...)``): streamed to the store, hashed on the way in.

The executor is handed the files open (it names no path) and checks every tensor against its hash as it loads;
one that does not match (a damaged or changed checkpoint file) is forgotten here, its file named in the log, and
brought from the client instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import tempfile
from pathlib import Path
from typing import Awaitable, Callable

from gpunet.errors import JobFailed, JobRejected, WorkerBusy
from gpunet.job.checkpoints import CheckpointIndex
from gpunet.job.format import Manifest, WeightRef, manifest_bytes
from gpunet.protocol import PIECE, holding
from gpunet.utils import LRU, human_bytes
from gpunet.worker.executor import RefFiles
from gpunet.worker.executor.cache import DiskCache

logger = logging.getLogger(__name__)

#: The most bytes of a cached container read to find its manifest (the manifest is capped at 4 MiB, and first).
MANIFEST_PREFIX_BYTES = 4 * 2**20 + 64


class TensorStore(DiskCache):
    """Tensors clients sent, as ``<dir>/<sha256>.tensor``: bounded LRU like the program cache (a tensor used is
    touched), written only once their bytes have matched the hash."""

    SUFFIX = ".tensor"
    MAX_FILES = 16384  # a model's spans name hundreds of tensors

    def __init__(self, directory, max_bytes: int, max_files: int = MAX_FILES):
        super().__init__(directory, max_bytes, max_files)
        #: Per tensor, the upload tokens of the clients that sent its bytes (gpunet.protocol.holding): a worker
        #: presenting a grant made with one of them may fetch it from here.
        self.tokens: LRU[str, frozenset[bytes]] = LRU(100_000)
        #: Tensors on their way here now, and from where: ``CLIENT`` (a peer asking hears "busy" and waits), or
        #: ``PEERS`` (fetched from other workers, which may be waiting on this one: see busy_for).
        self.coming: dict[str, str] = {}

    CLIENT, PEERS = "client", "peers"

    def expect(self, hashes, source: str) -> None:
        self.coming.update(dict.fromkeys(hashes, source))

    def busy_for(self, sha: str, own_id: str, peer_id: str) -> bool:
        """Whether a peer asking for a tensor on its way here should wait for it ("busy") rather than look
        elsewhere. Bytes from a client come for sure. Bytes this worker fetches from other workers may be fetched
        from the very peer asking (two workers each waiting for the other's copy until their time ran out, then
        both asking the client: CI saw it), so a worker waits only on one whose id sorts lower: waits then run one
        way, and a cycle cannot form."""
        source = self.coming.get(sha)
        return source == self.CLIENT or (source == self.PEERS and own_id < peer_id)

    def granted(self, sha: str, token: bytes | None) -> None:
        if token is not None:
            self.tokens.put(sha, frozenset([*list(self.tokens.get(sha) or ())[-3:], token]))

    def view(self, sha: str) -> memoryview | None:
        """A stored tensor's bytes, mapped read-only (None if it is not here)."""
        try:
            with open(self._path(sha), "rb") as f:
                return memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)) if os.fstat(f.fileno()).st_size \
                    else memoryview(b"")
        except (OSError, ValueError):
            return None

    def touch(self, sha: str) -> None:
        try:
            os.utime(self._path(sha))
        except OSError:
            pass

    def path(self, sha: str) -> Path:
        return self._path(sha)

    @contextlib.contextmanager
    def incoming(self, sha: str):
        """A temporary file to write a tensor's bytes to: moved in as ``sha`` when the block ends well (the caller
        checked them against the hash in it), removed when it raises."""
        tmp = tempfile.NamedTemporaryFile(dir=self.dir, prefix=".tmp-", delete=False)
        try:
            with tmp:
                yield tmp
            os.replace(tmp.name, self._path(sha))
        except BaseException:
            Path(tmp.name).unlink(missing_ok=True)
            raise
        self._evict(keep=self._path(sha))


class Weights:
    """Where the weights a program names by reference are, for one worker."""

    def __init__(self, models_dirs: tuple[str, ...] = (), index_cache: Path | None = None, disk: DiskCache | None = None,
                 max_store_bytes: int | None = None):
        """``disk``: the executors' program cache (the tensor store lives beside it, bounded by ``max_store_bytes``,
        by default as much as that cache; None: no store, so no weights from clients)."""
        self.index = CheckpointIndex(models_dirs, cache=index_cache) if models_dirs else None
        disk = disk if isinstance(disk, DiskCache) else None  # (a test's stand-in pool keeps no files)
        self.disk = disk
        store_bytes = disk.max_bytes if disk is not None and max_store_bytes is None else max_store_bytes
        self.store = TensorStore(disk.dir / "tensors", store_bytes) if disk is not None and store_bytes else None
        self.own_id = ""  # this worker's peer id (the verifier of the grants fetchers present)
        self._refs: LRU[str, tuple[WeightRef, ...]] = LRU(4096)  # program hash -> the weights it names
        self._sent_by: LRU[str, frozenset[str]] = LRU(100_000)  # sha -> the clients that sent those bytes here
        self.bytes_from_clients = 0  # since start
        self._ids: list[str] | None = None  # checkpoint_ids(), until the index changes

    async def start(self) -> None:
        """Index the models dirs (hashing only files new or changed since the last run)."""
        if self.index is None:
            return
        await asyncio.to_thread(self.index.scan)
        self._ids = None
        for folder, info in self.index.checkpoints().items():
            logger.info("Models dir: %s holds checkpoint %s (%d tensors, %s)", folder, info["id"][:12],
                        info["tensors"], human_bytes(info["bytes"]))

    # --- what a program names ---------------------------------------------------------------------------------------

    async def refs_of(self, program_hash: str, program: bytes | bytearray | None, checked: bool = True
                      ) -> tuple[WeightRef, ...]:
        """The weights a program names by reference, from its bytes or the disk cache. Kept per program hash only
        from bytes known to be that program's (``checked``; the disk cache holds only such): bytes a client sent are
        checked against the hash as they load, and until then say nothing about another client's program."""
        found = self._refs.get(program_hash)
        if found is not None:
            return found
        if program is None:
            program = None if self.disk is None else await asyncio.to_thread(
                self.disk.read_range, program_hash, 0, MANIFEST_PREFIX_BYTES)
            if program is None:  # only in an executor's memory (loaded: it needs nothing), or evicted meanwhile
                return ()        # (that executor says so, and the client sends it again)
        found = await asyncio.to_thread(_named, program)  # (up to 4 MiB of JSON: off the loop)
        if checked:
            self._refs.put(program_hash, found)
        return found

    async def loaded(self, program_hash: str, program: bytes | bytearray) -> None:
        """A client's bytes ran, so they are the program's (the executor checked them against its hash): what they
        name is kept for its later jobs."""
        if self._refs.get(program_hash) is None:
            self._refs.put(program_hash, await asyncio.to_thread(_named, program))

    # --- where they are ---------------------------------------------------------------------------------------------

    async def prepare(self, client_id: str, program_hash: str, program, private: bool,
                      ask: Callable[[list[WeightRef], "TensorStore"], Awaitable[None]], checked: bool = True
                      ) -> RefFiles | None:
        """Where every weight the program names lies (None: it names none), asking the client (``ask``) for those
        found nowhere here. ``checked``: as for :meth:`refs_of`."""
        refs = await self.refs_of(program_hash, program, checked)
        if not refs:
            return None
        found, missing = self._locate(client_id, refs)
        if missing:
            if private or self.store is None:
                raise JobRejected(
                    f"this worker holds {len(missing)} of the weights the program names by reference nowhere "
                    "(and keeps no private weights on disk): send them in the program, or choose a worker that holds "
                    "the checkpoint")
            wanted = sum(r.nbytes for r in missing)
            if wanted > self.store.max_bytes or len(missing) > self.store.max_files:
                raise JobRejected(f"the program names {human_bytes(wanted)} of weights this worker lacks, more than "
                                  f"its tensor store holds ({human_bytes(self.store.max_bytes)}): choose a worker "
                                  "that keeps the checkpoint")
            self.store.expect((r.sha256 for r in missing), TensorStore.PEERS)
            try:
                await ask(missing, self.store)
            finally:
                for r in missing:
                    self.store.coming.pop(r.sha256, None)
            for r in missing:
                self._sent_by.put(r.sha256, (self._sent_by.get(r.sha256) or frozenset()) | {client_id})
                self.bytes_from_clients += r.nbytes
            found, missing = self._locate(client_id, refs)
            if missing:  # evicted as soon as written: the store is smaller than the program's weights
                raise JobFailed(f"this worker's tensor store cannot hold the program's weights "
                                f"({human_bytes(sum(r.nbytes for r in refs))})")
        paths: dict[str, int] = {}
        entries = [[sha, paths.setdefault(path, len(paths)), offset, length] for sha, (path, offset, length) in found.items()]
        return RefFiles(entries, list(paths))

    def _locate(self, client_id: str, refs: tuple[WeightRef, ...]) -> tuple[dict, list[WeightRef]]:
        found, missing, seen = {}, [], set()
        for r in refs:
            if r.sha256 in seen:  # one tensor named twice (tied weights)
                continue
            seen.add(r.sha256)
            loc = self.index.find(r.sha256) if self.index is not None else None
            if loc is not None and loc.length == r.nbytes:
                found[r.sha256] = (loc.path, loc.offset, loc.length)
                continue
            if self.store is not None and client_id in (self._sent_by.get(r.sha256) or ()):
                size = self.store.size(r.sha256)
                if size == r.nbytes:
                    found[r.sha256] = (str(self.store.path(r.sha256)), 0, size)
                    self.store.touch(r.sha256)
                    continue
            missing.append(r)
        return found, missing

    def condemn(self, hashes: tuple[str, ...]) -> None:
        """Weights that did not match their hash as they loaded: never offered from where they were again (a models
        dir file is re-hashed at the next start; a stored copy is deleted)."""
        self._ids = None
        for sha in hashes:
            path = self.index.forget(sha) if self.index is not None else None
            if path is not None:
                logger.warning("Models dir: %s no longer holds what it held when indexed (tensor %s does not match "
                               "its hash): damaged or changed; that tensor is brought from elsewhere", path, sha[:16])
            if self.store is not None and sha in self.store:
                logger.warning("Tensor store: %s did not match its hash; deleted", sha[:16])
                self.store.path(sha).unlink(missing_ok=True)

    def for_peer(self, sha: str, peer_id: str, grant: bytes | None) -> memoryview | Exception | None:
        """A tensor for another worker: one of the models dirs' checkpoints (public: the volunteer serves them to
        all), or one a client sent here, to a worker presenting that client's grant (made with its upload token).
        Its bytes as held now (the fetcher checks them against the hash); WorkerBusy while it is on its way here;
        a refusal, or None when it is not here."""
        view = self.index.read(sha) if self.index is not None else None
        if view is not None or self.store is None:
            return view
        tokens = self.store.tokens.get(sha)
        if tokens and sha in self.store:
            if grant is not None and any(holding.verifies(t, grant, PIECE, self.own_id, peer_id) for t in tokens):
                return self.store.view(sha)
            return JobRejected("these weights are a client's: they go only to a worker it granted them to")
        if self.store.busy_for(sha, self.own_id, peer_id):
            return WorkerBusy("these weights are on their way here; ask again")
        return None

    def checkpoint_ids(self) -> list[str]:
        """The checkpoints held in full, for the worker's record (sorted: the record changes only when they do)."""
        if self._ids is None:
            self._ids = sorted({info["id"] for info in self.index.checkpoints().values() if info["complete"]}
                               ) if self.index is not None else []
        return self._ids

    def describe(self) -> dict:
        """What the dashboard and doctor show: the checkpoints held, and the bytes of the models dirs."""
        if self.index is None:
            return {"checkpoints": {}, "bytes": 0}
        return {"checkpoints": self.index.checkpoints(), "bytes": self.index.total_bytes}


def _named(program) -> tuple[WeightRef, ...]:
    return Manifest.from_json(manifest_bytes(program)).refs
