"""Programs between workers: a worker serves pieces of the programs it holds, and fetches a program it lacks from
peers that hold it, so a program's weights cross the client's uplink once, not once per worker.

Serving is bounded: only programs in this worker's disk cache (which holds only public programs it received, checked
against their hash and loaded; a private program's bytes never reach the disk), and of those only shared ones or to a
fetcher that presents its client's grant (a proof, made from the program's bytes, naming this holder and that
fetcher: :mod:`gpunet.protocol.holding`), since a hash is published and no capability; whole pieces at the piece size
the program's size implies, :data:`SERVE_AT_ONCE` at once (:data:`SERVE_STREAMS` streams, :data:`SERVE_PER_PEER` per
peer), optionally at most ``rate`` bytes a second in all. Nothing else on the machine can be named: a request is a
program hash and a piece index.

Fetching checks every piece against the digest the job's client gave (:class:`gpunet.protocol.Pieces`): a peer that
serves a wrong byte is caught at that piece, which is fetched from another peer; once another peer's copy of that
piece matches (so the client's digest was right), the first is banned. The assembled program is checked against its
hash like any program. Whatever does not arrive in time is asked of the client after all. Holders are reached by peer
id through the p2p layer (which knows their addresses), never at an address a client gave: a client could name any,
the worker's own loopback or its owner's LAN among them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from typing import Awaitable, Callable, Sequence

from gpunet import protocol
from gpunet.errors import GpunetError, JobRejected, NetworkError, ProgramNotCached, WorkerBusy
from gpunet.protocol import Door, Error, GetPiece, Have, PieceData, holding, holding_key
from gpunet.protocol.holding import PIECE
from gpunet.protocol.peers import PieceList, count, piece_size_for
from gpunet.utils import LRU
from gpunet.worker import metrics
from gpunet.worker.spool import SpooledProgram, program_buffer
from gpunet.worker.uploads import content_hash

logger = logging.getLogger(__name__)

#: Pieces sent at once (the rest wait their turn), and streams open at once: a stream waiting for a piece this
#: holder is still getting (HAVE_WAIT) costs a slot of SERVE_STREAMS, not one of SERVE_AT_ONCE.
SERVE_AT_ONCE = 4
SERVE_STREAMS = 16
SERVE_PER_PEER = 2  # streams, per peer identity and per network address (identities are free)
#: A serving stream with no request for this long is closed, and none lives longer than STREAM_LIFETIME.
STREAM_IDLE = 30.0
STREAM_LIFETIME = 600.0
#: How often a holder that does not have the program yet (it is still receiving it) is asked again, and for how long
#: one is waited for that the client did not say it is sending the program to (anyone may claim to hold anything).
NOT_YET_RETRY = 0.5
BUSY_PATIENCE = 10.0
#: A holder still getting a piece asked of it waits this long for it (checking every HAVE_POLL) before it answers
#: with the pieces it has (Have): a fetcher waiting on the swarm's front costs one request per HAVE_WAIT.
HAVE_WAIT = 2.0
HAVE_POLL = 0.2
#: A piece a copy coming from its client sent this long ago is sent again when asked: the fetcher it went to may have
#: dropped it (no room for the program, its job cancelled, gone).
RESEND_AFTER = 10.0
#: How long a request waits for a sending place before it hears "busy" (well within the fetcher's frame timeout).
SEND_WAIT = 5.0
#: A fetch from holders the client vouches for goes on, whatever they answer (busy serving others, or their copy
#: still coming), while the swarm moves: it ends when no piece came and no holder's copy grew for this long (checked
#: every STALL_CHECK). On slow links a holder can be busy for long stretches and still be the fastest way.
HOLDER_STALL = 30.0
STALL_CHECK = 1.0
#: The longest wait between two askings of a busy holder.
BUSY_BACKOFF = 2.0
#: Times in a row a stream to a holder that could not be opened is tried again (after NOT_YET_RETRY): a holder busy
#: loading what it just received on a loaded machine can miss one stream, and giving up on it sends the client's link
#: a copy.
OPEN_RETRIES = 3
#: Times in all the holders the client vouches for (``coming``) are asked, when every stream to them ends early.
VOUCHED_ROUNDS = 3
#: Broken streams to a vouched-for holder that one stream task takes before it gives up on that holder.
COMING_FAILURES = 8
#: Peers a fetch asks in all, those the client named and those met fetching the same program (_Fetch.met).
MAX_MET = 16
#: How long a peer that served a corrupted piece is not asked again.
BAN_SECONDS = 3600.0
#: Bytes written between two waits of the upload cap: the fetcher sees steady progress, never one long pause.
PACE_CHUNK = 256 * 1024


class PieceServer:
    """The ``piece`` door."""

    def __init__(self, disk, rate: float | None = None, coming: Callable[[str], bool] = lambda h: False,
                 clock=time.monotonic, corrupt: bool = False,
                 may_serve: Callable[[str, str, bytes | None, object, bool], Awaitable[bool]] | None = None,
                 tensors: Callable[[str, str, bytes | None], object] | None = None):
        """``disk``: the executor's :class:`~gpunet.worker.executor.cache.DiskCache`; ``rate``: bytes a second in all;
        ``coming(hash)``: whether that program is on its way in (a fetcher asking for it then hears "busy", and asks
        again, rather than "not cached"); truthy, it may be the Upload it comes in as, whose pieces that have arrived
        are served meanwhile (``size``, ``piece(start, length)``); ``may_serve(hash, fetcher's peer id, grant, upload, from_disk)``: whether
        that fetcher may have the program's pieces (``upload``: the copy on its way here, if any; ``from_disk``: they
        would come from the disk's copy, not from that one) (None: any fetcher, as tests of serving alone use); ``tensors(sha256, fetcher's peer id, grant)``:
        a tensor's bytes for that fetcher (gpunet.worker.weights.Weights.for_peer), a refusal, or None."""
        self.disk, self.rate, self.coming, self.clock = disk, rate, coming, clock
        self.tensors = tensors
        self.may_serve = may_serve
        self.corrupt = corrupt  # FAULT INJECTION (tests): one byte of every piece served is wrong
        self.served = 0  # bytes, since start
        self._running = 0
        self._sending: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._streams: Counter[str] = Counter()  # per peer id and per host
        self._next_free = 0.0  # rate limit: when the bytes sent so far have "drained" at ``rate``

    async def start(self, rpc) -> None:
        await rpc.serve_stream(Door.PIECE, self.handle)

    async def handle(self, peer_id: str, reader, writer, host: str = "") -> None:
        keys = [f"id:{peer_id}"] + ([f"host:{host}"] if host else [])
        try:
            if self._running >= SERVE_STREAMS or any(self._streams[k] >= SERVE_PER_PEER for k in keys):
                await protocol.write(writer, Error.of(WorkerBusy("serving as many peers as it takes; ask again")))
                return
            self._running += 1
            self._streams.update(keys)
            try:
                async with asyncio.timeout(STREAM_LIFETIME):
                    while True:
                        try:
                            request = await protocol.read(reader, GetPiece, timeout=STREAM_IDLE)
                        except GpunetError:
                            return  # the fetcher is done (EOF), stalled, or sent something else: goodbye
                        if not await self._serve(request, writer, peer_id):
                            return  # after a refusal the stream ends: a slot is for fetching, not for asking
            finally:
                self._running -= 1
                self._streams.subtract(keys)
                for k in keys:
                    if self._streams[k] <= 0:
                        del self._streams[k]
        except (GpunetError, ConnectionError, OSError, TimeoutError) as e:
            logger.debug("serving pieces to %s stopped: %s", peer_id[-8:], e)
        finally:
            writer.close()

    async def _serve(self, request: GetPiece, writer, peer_id: str = "") -> bool:
        """Serve one piece; False (after saying why) when it cannot. A sending place (SERVE_AT_ONCE) is taken before
        the piece is read, and waited for at most SEND_WAIT (then "busy"): queued streams hold no piece in memory,
        and no fetcher waits for its answer longer than it waits for any frame. A piece of a copy still on its way
        here (to a fetcher its client granted it) is waited for up to HAVE_WAIT, holding no place; then a fetcher
        that takes it hears which pieces are here (:class:`Have`), others "busy"."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HAVE_WAIT
        while True:
            if not await self._take_place():
                return await self._send(writer, None, WorkerBusy("serving as many peers as it takes; ask again"))
            try:
                upload = None
                if request.tensor:  # (a read of a mapped file: off the loop)
                    data, refusal = await asyncio.to_thread(self._tensor_piece, request, peer_id)
                else:
                    data, refusal, upload = await self._program_piece(request, peer_id)
                # Waited for only when the copy's size is known, so the fetcher's grant was checked against it.
                if not (request.have and isinstance(refusal, WorkerBusy) and upload is not None):
                    # A copy still coming says what it has with each piece, to a fetcher that takes it.
                    growing = request.have and upload is not None and upload.here() < upload.size
                    if not (growing and data is not None and upload.seeding and request.sent):
                        return await self._send(writer, data, refusal, self._have(upload, request) if growing else None)
                    # From its client itself: each piece leaves once (being sent, or sent within RESEND_AFTER: the
                    # fetcher it went to may have dropped it); one that went is waited for like a piece not here yet
                    # (its claim may lapse, or the copy be whole), then the fetcher hears it went (Have.sent).
                    index = request.index
                    if not self._went(upload, index):
                        upload.sent[index] = self.clock()
                        done = False
                        try:
                            done = await self._send(writer, data, None, self._have(upload, request))
                            return done
                        finally:
                            if not done:  # a send that failed gives the piece back
                                upload.sent.pop(index, None)
            finally:
                self._sending[1].release()
            if loop.time() >= deadline:
                await protocol.write(writer, self._have(upload, request))
                return True
            await asyncio.sleep(HAVE_POLL)

    def _went(self, upload, index: int) -> bool:
        sent = upload.sent.get(index)
        return sent is not None and self.clock() - sent < RESEND_AFTER

    def _have(self, upload, request: GetPiece) -> Have:
        """What a copy still coming has (and, coming from its client, which of those went already)."""
        n = count(upload.size, request.piece_size)
        went = [i for i in upload.sent if self._went(upload, i)] if upload.seeding and request.sent else ()
        return Have.of(upload.have(request.piece_size), n, went)

    async def _take_place(self) -> bool:
        loop = asyncio.get_running_loop()
        if self._sending is None or self._sending[0] is not loop:
            self._sending = (loop, asyncio.Semaphore(SERVE_AT_ONCE))
        try:
            await asyncio.wait_for(self._sending[1].acquire(), SEND_WAIT)
        except TimeoutError:
            return False
        return True

    async def _program_piece(self, request: GetPiece, peer_id: str):
        """(the piece's bytes, or why not, and the copy still coming here if that is where it is served from)."""
        size = await asyncio.to_thread(self.disk.size, request.program)
        coming = self.coming(request.program)
        # Not on disk yet but on its way (from its client, or fetched from peers): what has arrived is served.
        upload = coming if size is None and getattr(coming, "size", None) is not None else None
        if upload is not None:
            size = upload.size
        refusal = None
        if size is None:
            refusal = (WorkerBusy("this program is on its way here; ask again") if coming else
                       ProgramNotCached(request.program))
        elif self.may_serve is not None and not await self.may_serve(
                request.program, peer_id, request.grant, upload or (coming if getattr(coming, "size", None) else None),
                upload is None):
            refusal = JobRejected("this program is not shared: its pieces go only to a worker whose client holds it "
                                  "(its grant is missing or does not match)")
        elif request.piece_size != piece_size_for(size) or request.index * request.piece_size >= size:
            refusal = JobRejected("no such piece of this program")  # says nothing of its size
        data = None
        if refusal is None and upload is not None:
            data = upload.piece(request.index * request.piece_size, request.piece_size)
            if data is None:
                refusal = WorkerBusy("this piece is on its way here; ask again")
        elif refusal is None:
            data = await asyncio.to_thread(self.disk.read_range, request.program, request.index * request.piece_size,
                                           request.piece_size)
            if data is None:  # evicted meanwhile
                refusal = ProgramNotCached(request.program)
        return data, refusal, upload

    def _tensor_piece(self, request: GetPiece, peer_id: str) -> tuple[bytes | None, Exception | None]:
        view = self.tensors(request.program, peer_id, request.grant) if self.tensors is not None else None
        if isinstance(view, Exception):
            return None, view
        if view is None:
            return None, ProgramNotCached(request.program)  # (no tensor of that hash here)
        size = view.nbytes
        if request.piece_size != piece_size_for(size) or request.index * request.piece_size >= max(size, 1):
            return None, JobRejected("no such piece of this tensor")
        start = request.index * request.piece_size
        return bytes(view[start:start + request.piece_size]), None

    async def _send(self, writer, data: bytes | None, refusal: Exception | None, have: Have | None = None) -> bool:
        if refusal is not None:
            await protocol.write(writer, Error.of(refusal))
            return False
        if self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        await protocol.write(writer, PieceData(len(data), have.pieces, have.sent) if have is not None
                             else PieceData(len(data)))
        view = memoryview(data)
        async with asyncio.timeout(protocol.payload_deadline(len(data)) + len(data) / (self.rate or float("inf"))):
            for start in range(0, len(data), PACE_CHUNK):  # a fetcher that stops reading cannot hold the slot
                chunk = view[start:start + PACE_CHUNK]
                await self._pace(len(chunk))
                await protocol.write_payload(writer, chunk)
        self.served += len(data)
        metrics.PEER_BYTES_SERVED.inc(len(data))
        return True

    async def _pace(self, nbytes: int) -> None:
        if not self.rate:
            return
        now = self.clock()
        start = max(now, self._next_free)
        self._next_free = start + nbytes / self.rate
        if start > now:
            await asyncio.sleep(start - now)


class PeerBans:
    """Peers caught serving corrupted pieces, not asked again for a while."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._until: LRU[str, float] = LRU(10_000)

    def ban(self, peer_id: str) -> None:
        self._until.put(peer_id, self.clock() + BAN_SECONDS)

    def banned(self, peer_id: str) -> bool:
        until = self._until.get(peer_id)
        return until is not None and until > self.clock()


class Fetcher:
    """Fetches programs from peers for this worker (see the module docstring)."""

    def __init__(self, rpc, own_id: str, bans: PeerBans | None = None, spool_dir: str | None = None):
        """``spool_dir``: where a big program is assembled (gpunet.worker.spool); None: in memory."""
        self.rpc, self.own_id, self.spool_dir = rpc, own_id, spool_dir
        self.bans = bans or PeerBans()
        self.fetched = 0  # bytes, since start

    async def fetch(self, program_hash: str, pieces: PieceList, holders: Sequence[str], timeout: float,
                    coming: frozenset[str] = frozenset(), on_first: Callable[[], None] | None = None,
                    grants: dict[str, bytes] | None = None, serve: Callable[[object], None] | None = None,
                    token: bytes | None = None) -> tuple[bytearray, bytes] | None:
        """The program's bytes, every piece and then the whole checked against ``program_hash``, with its holding key
        (:mod:`gpunet.protocol.holding`, computed in the same pass); None if the peers could not deliver them within
        ``timeout``. ``holders``: peer ids, dialled through the p2p layer only. ``grants``: per holder, the client's
        proof to present to it (a program that is not shared is served only against one). ``coming``: holders that
        are still receiving it from the client, waited for while they say so. Peers caught serving a wrong piece are
        banned only once the whole program is proven right (so neither a client's wrong list nor an accomplice of it
        can get honest holders banned).

        ``on_first``: called once the first right piece is here, before the program's memory is taken (the worker
        charges its buffer budget then, not while a holder that may never deliver keeps it waiting); what it raises
        ends the fetch (None). ``serve(fetch)``: told of the fetch as it starts, whose ``piece(start, length)`` gives
        the pieces it has so far (this worker serves them to others meanwhile). ``token``: the client's upload token
        for the program, with which this worker grants itself pieces from peers it meets fetching the same program
        (they asked it for pieces with a grant of that client's: :meth:`_Fetch.met`): a holder named to a fetcher
        early learns of those named to later ones, so the whole swarm serves, not only its first holders."""
        peers = [p for p in dict.fromkeys(holders) if p != self.own_id and not self.bans.banned(p)]
        if not peers:
            return None
        run = _Fetch(self, program_hash, pieces, coming, on_first, grants or {}, token)
        if serve is not None:  # what it has fetched so far is served to other workers meanwhile
            serve(run)
        deadline = time.monotonic() + timeout
        # Two streams per peer when there are few (as many as a peer serves one fetcher): one piece's round trip and
        # disk read overlap the other's transfer. With more, one each: many pieces at once over one slow link would
        # each come too slowly.
        streams = SERVE_PER_PEER if len(peers) <= 2 else 1
        run.known.update(peers)
        try:
            for _ in range(VOUCHED_ROUNDS):
                tasks = [asyncio.ensure_future(run.from_peer(peer)) for peer in peers for _ in range(streams)]
                try:
                    # Until every piece is here or every stream ended, within the deadline, while the swarm moves: a
                    # piece came, or some holder's copy grew, within HOLDER_STALL.
                    pending = set(tasks)
                    while pending and time.monotonic() < deadline:
                        _, pending = await asyncio.wait(pending, timeout=min(STALL_CHECK, deadline - time.monotonic()))
                        while run.joined:  # peers met fetching it too: asked as well, one stream each
                            peer = run.joined.pop()
                            peers.append(peer)
                            tasks.append(asyncio.ensure_future(run.from_peer(peer)))
                            pending.add(tasks[-1])
                        if pending and time.monotonic() - run.moved > HOLDER_STALL:
                            logger.info("Fetching program %s from peers: nothing came and no holder's copy grew for "
                                        "%.0f s", program_hash[:12], HOLDER_STALL)
                            run.stalled = True
                            break
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                # Every stream ended early: holders the client vouches for are asked again (a stream reset, a holder
                # still settling in), and peers met meanwhile; the others said what they had to say.
                peers += run.joined
                run.joined.clear()
                suspects = run.convicted.union(*run.wrong.values())  # served a piece that did not match
                peers = [p for p in peers if p in run.coming and p not in suspects]
                if (run.refused is not None or run.stalled or not run.missing or not peers
                        or deadline - time.monotonic() < 2 * NOT_YET_RETRY):
                    break
                await asyncio.sleep(2 * NOT_YET_RETRY)
        finally:
            run.over = True  # peers meeting it from now on are not asked
        if run.refused is not None:
            logger.info("Fetching program %s from peers stopped: %s", program_hash[:12], run.refused)
            return None
        if run.missing:
            logger.info("Fetched %d of %d pieces of program %s from peers; the rest is asked of the client",
                        len(pieces) - len(run.missing), len(pieces), program_hash[:12])
            return None
        found, key = await asyncio.to_thread(hash_and_key, run.buffer)
        if found != program_hash:
            logger.warning("Program %s assembled from peers does not match its hash (the client's piece list and "
                           "the peers agree on other bytes); asking the client for it", program_hash[:12])
            return None
        for liar in run.convicted:
            logger.warning("Banned peer %s for %.0f s: it served a corrupted piece of program %s", liar[-8:],
                           BAN_SECONDS, program_hash[:12])
            self.bans.ban(liar)
        seconds = time.monotonic() - run.started
        logger.info("Fetched program %s (%d bytes) from %d peer(s) in %.2f s (%.0f MB/s)", program_hash[:12],
                    pieces.size, len(run.sources), seconds, pieces.size / max(seconds, 1e-9) / 1e6)
        self.fetched += pieces.size
        metrics.PEER_BYTES_FETCHED.inc(pieces.size)
        return run.buffer, key


    async def fetch_tensors(self, wanted: list, holders: Sequence[str], store, timeout: float,
                            grants: dict[str, bytes] | None = None, token: bytes | None = None) -> list:
        """Weights named by reference (``wanted``: WeightRefs) from other workers, each tensor from one holder at a
        time (two streams per holder), checked against its hash as it arrives and moved into ``store``; a holder
        that serves a wrong byte or lacks it is not asked for that tensor again, one that says it is on its way is
        asked again. ``grants``: per holder, the client's (for weights a client sent there); ``token``: the client's
        upload token, with which what is fetched here is granted on. Returns those not fetched within ``timeout``
        (the client sends them)."""
        peers = [p for p in dict.fromkeys(holders) if p != self.own_id and not self.bans.banned(p)]
        todo = list(wanted)
        flying: list = []  # being fetched from some holder now: back in todo if that holder fails
        tried: dict[str, set[str]] = {}
        changed = asyncio.Event()  # set when a tensor comes back to todo or lands

        async def from_peer(peer: str) -> None:
            broken = 0  # streams to this peer that broke (it is asked again a few times: a busy holder drops some)
            while todo or flying:
                ref = next((r for r in todo if peer not in tried.get(r.sha256, ())), None)
                if ref is None:
                    # Nothing here for this peer now, but a tensor another holder is fetching may come back to it
                    # (that holder lacks it after all): it waits for that rather than leave it to the client.
                    if not any(peer not in tried.get(r.sha256, ()) for r in flying):
                        return
                    changed.clear()
                    await changed.wait()
                    continue
                todo.remove(ref)
                flying.append(ref)
                landed, error = False, None
                try:
                    await self._tensor_from(peer, ref, store, (grants or {}).get(peer), token)
                    landed = True
                except Exception as e:
                    error = e
                finally:  # (also when cancelled)
                    flying.remove(ref)
                    if not landed:
                        todo.append(ref)
                    changed.set()  # whoever waits on it looks again
                if landed:
                    continue
                if isinstance(error, _Busy):  # on its way there: asked again for as long as the fetch may take
                    await asyncio.sleep(NOT_YET_RETRY)
                    continue
                transient = isinstance(error, (NetworkError, ConnectionError, OSError, TimeoutError)) and \
                    not isinstance(error, _WrongBytes)
                broken += transient
                if not transient or broken > COMING_FAILURES:  # it lacks it, refused, or served wrong bytes
                    tried.setdefault(ref.sha256, set()).add(peer)
                    logger.info("Fetching tensor %s from %s stopped: %s", ref.sha256[:12], peer[-8:], error)
                    if not transient and not isinstance(error, GpunetError):
                        return
                    continue
                await asyncio.sleep(NOT_YET_RETRY * min(broken, 4))

        tasks = [asyncio.ensure_future(from_peer(peer)) for peer in peers for _ in range(SERVE_PER_PEER)]
        if tasks:
            try:
                await asyncio.wait(tasks, timeout=timeout)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        left = [r for r in wanted if r.sha256 not in store]
        got = sum(r.nbytes for r in wanted) - sum(r.nbytes for r in left)
        if got:
            self.fetched += got
            metrics.PEER_BYTES_FETCHED.inc(got)
            logger.info("Fetched %d weight(s) (%d bytes) from workers that keep their checkpoint; %d left to the "
                        "client", len(wanted) - len(left), got, len(left))
        return left

    async def _tensor_from(self, peer: str, ref, store, grant: bytes | None = None, token: bytes | None = None
                           ) -> None:
        """One tensor from ``peer``, piece by piece on one stream, hashed as it comes; into ``store`` if it matches."""
        size = ref.nbytes
        piece = piece_size_for(size)
        try:
            reader, writer = await self.rpc.open(peer, Door.PIECE)
        except NetworkError as e:
            raise _Unreachable(str(e)) from None  # gone: not asked again (a broken stream is)
        hasher = hashlib.sha256()
        try:
            with store.incoming(ref.sha256) as tmp:
                for index in range(max(1, -(-size // piece))):
                    length = min(piece, size - index * piece)
                    await protocol.write(writer, GetPiece(ref.sha256, index, piece, grant, tensor=True))
                    reply = await protocol.read(reader, PieceData, Error, timeout=protocol.FRAME_TIMEOUT)
                    if isinstance(reply, Error):
                        error = reply.exception()
                        raise _Busy() if isinstance(error, WorkerBusy) else error
                    if reply.size != length:
                        raise _WrongBytes(f"piece {index} of {reply.size} bytes; it has {length}")
                    await protocol.read_payload(reader, length, length, "tensor piece", hasher,
                                                timeout=protocol.payload_deadline(length), into=tmp)
                if hasher.hexdigest() != ref.sha256:
                    raise _WrongBytes(f"it served tensor {ref.sha256[:12]} with bytes that do not match its hash")
            store.granted(ref.sha256, token)  # whom its client grants it to may fetch it from here too
        finally:
            writer.close()


def hash_and_key(data: bytearray) -> tuple[str | None, bytes]:
    return content_hash(data), holding_key(data)


class _Busy(Exception):
    """The peer cannot serve this piece yet (still receiving the program) or now (serving others)."""


class _Unreachable(Exception):
    """No stream to the peer could be opened (it is gone, or never answered): it is not asked again."""


class _WrongBytes(Exception):
    """The peer served bytes that are not the tensor asked for (a damaged or changed file, or a liar)."""


class _Fetch:
    """One program's fetch: which pieces are still missing, and who tried to pass off a wrong one."""

    def __init__(self, fetcher: Fetcher, program_hash: str, pieces: PieceList, coming: frozenset[str],
                 on_first: Callable[[], None] | None = None, grants: dict[str, bytes] | None = None,
                 token: bytes | None = None):
        self.fetcher, self.program_hash, self.pieces = fetcher, program_hash, pieces
        self.coming = set(coming)  # vouched holders: the client named them, or they came with its grant (met)
        self.grants = dict(grants or {})
        self.token = token
        self.known: set[str] = set()  # every peer this fetch asks (or asked)
        self.joined: list[str] = []  # peers met meanwhile, not yet asked (Fetcher.fetch starts their streams)
        self.met_peers: set[str] = set()
        self.over = False  # the fetch from peers has ended (whatever the client still sends)
        self.started = time.monotonic()
        self.on_first = on_first
        self.refused: Exception | None = None  # what on_first raised: the fetch is over
        self.buffer: bytearray | SpooledProgram | None = None  # taken with the first right piece
        self.progress: dict[str, float] = {}  # when each peer last delivered a piece
        self.missing = set(range(len(pieces)))
        self.todo = list(range(len(pieces)))
        self.wrong: dict[int, set[str]] = {}
        self.convicted: set[str] = set()  # sent a piece another peer's matching copy proved wrong
        self.sources: set[str] = set()
        self.changed = asyncio.Event()  # a piece arrived, or went back to be fetched by someone else
        #: What each holder that is still getting the program said it has (Have); one absent is asked for anything.
        self.theirs: dict[str, set[int]] = {}
        self.declined: dict[str, int] = {}  # the piece each last said it lacks (left to others for a moment)
        #: Of each holder's pieces, those it sent on already while its copy comes from the client (Have.sent): it
        #: sends each once, so they are asked of the fetchers that have them.
        self.spent: dict[str, set[int]] = {}
        self.asking: Counter[str] = Counter()  # streams fetching from each peer now
        self.unreliable: set[str] = set()  # said it had a piece, then that it did not: its growth is not progress
        self.moved = self.started  # when a piece last came, or some holder's copy last grew
        self.stalled = False

    def _take(self, peer: str, waited: bool = False) -> int | None:
        """The next piece to ask ``peer`` for, if any now: of those it has (as far as this fetch knows; one that never
        said is asked for anything), the one the fewest other holders still getting the program have (rarest first:
        the holder nearest the client is not asked for what others can serve). Else, while no other holder asked may
        have anything (every one said what it has), one none of them has: it waits a moment for it there, then says
        what it has. Else, ``waited`` (HAVE_WAIT with nothing new), any but the one it just said it lacks."""
        self.todo = [i for i in self.todo if i in self.missing]
        has, spent = self.theirs.get(peer), self.spent.get(peer, set())
        # (a piece a holder sent on already, it does not send again: not one it offers)
        others = [h - self.spent.get(p, set()) for p, h in self.theirs.items() if p != peer]
        rarity = {i: sum(i in h for h in others) for i in self.todo}
        index = min((i for i in self.todo if (has is None or i in has) and i not in spent), key=rarity.__getitem__,
                    default=None)
        if index is None and (waited or all(p in self.theirs for p in self.asking if p != peer)):
            declined = self.declined.get(peer) if not waited else None
            index = next((i for i in self.todo if i != declined and (waited or not rarity[i] and i not in spent)),
                         None)
        if index is not None:
            self.todo.remove(index)
        return index

    async def _next(self, peer: str) -> int | None:
        """:meth:`_take`, waiting for one: when none is left to hand out but some are still on their way from slower
        peers, one of those may fail and come back (no piece is left to a peer that gave up)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + HAVE_WAIT
        while self.missing and self.refused is None:
            index = self._take(peer, waited=loop.time() >= until)
            if index is not None:
                return index
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), max(0.0, until - loop.time()) if self.todo else None)
            except TimeoutError:
                pass
        return None

    def met(self, peer: str) -> None:
        """``peer`` asked this worker for pieces of the program with a grant its client made with the same upload
        token (so the client is sending it the program too, or pointed it here): it is fetching the same copy, and
        serves what it has, so it is asked too (vouched, as the client's own holders are), against a grant this
        worker makes with that token. At most MAX_MET such peers; none once the fetch is over or has no token."""
        if (self.token is None or self.over or not self.missing or self.refused is not None or self.stalled
                or peer in self.known or peer == self.fetcher.own_id or self.fetcher.bans.banned(peer)
                or len(self.known) >= MAX_MET):
            return
        self.known.add(peer)
        self.met_peers.add(peer)
        self.coming.add(peer)
        self.grants[peer] = holding.proof(self.token, PIECE, peer, self.fetcher.own_id)
        self.joined.append(peer)

    def here(self) -> int:
        """Bytes of it here so far."""
        return 0 if self.buffer is None else self.pieces.size - sum(self.pieces.span(i)[1] for i in self.missing)

    def have(self, piece_size: int) -> set[int]:
        """The pieces this fetch has (served to other workers meanwhile)."""
        return set() if self.buffer is None else set(range(len(self.pieces))) - self.missing

    def _account(self, peer: str, said: Have, seen: set[int], lacks: int | None = None) -> None:
        """``peer`` (one the client vouches for) is still getting the program and says it has ``said`` (and not
        ``lacks``); ``seen``: what it said before on this stream. A copy on its way in loses pieces only when it starts
        over (its own fetch failed, and its client sends the program): one stream's replies are in order, so a piece
        listed and then not is that, or a lie. Either way its copy growing no longer counts as the swarm moving (a
        liar cannot keep a fetch going)."""
        have = {i for i in said.indices() if i < len(self.pieces)}
        if lacks in seen or seen - have:
            self.unreliable.add(peer)
            self.theirs.pop(peer, None)
        seen.clear()
        seen |= have
        # Only a copy from the client itself sends each piece once; one a peer met fetching says nothing of the kind.
        self.spent[peer] = said.sent_indices() & have if peer not in self.met_peers else set()
        self._heard(peer, have)

    def _heard(self, peer: str, have: set[int]) -> None:
        """``peer`` (one the client vouches for) is still getting the program, and has ``have``. It counts as the
        swarm moving when it has a piece this fetch needs and may ask of it (not one it sent on already); a peer met
        fetching, only once it has delivered a piece (its word alone keeps no fetch going)."""
        new = (have - self.theirs.get(peer, set()) - self.spent.get(peer, set())) & self.missing
        if new and peer not in self.unreliable and (peer not in self.met_peers or peer in self.sources):
            self.moved = time.monotonic()  # (_take asks for them at once)
        self.theirs[peer] = self.theirs.get(peer, set()) | have

    def piece(self, start: int, length: int) -> bytes | None:
        """Bytes of a piece this fetch has (checked against its digest), for another worker; None if not yet."""
        index = start // self.pieces.piece_size
        if self.buffer is None or index in self.missing or start != self.pieces.span(index)[0]:
            return None
        return bytes(self.buffer[start:start + min(length, self.pieces.span(index)[1])])

    def _give_back(self, index: int) -> None:
        self.todo.append(index)
        self.changed.set()

    async def from_peer(self, peer: str) -> None:
        """Fetch pieces from ``peer`` until none is missing or it fails; a busy peer is asked again later (a stream
        it turned away is closed, so a fresh one is opened), for as long as it is worth waiting for. A peer the client
        vouches for (``coming``: still getting the program itself, and serving what it has) is asked again after a
        broken stream too, up to COMING_FAILURES times: a holder serving many fetchers at once drops some."""
        self.asking[peer] += 1
        try:
            await self._from_peer_again(peer)
        finally:
            self.asking[peer] -= 1
            if not self.asking[peer]:
                del self.asking[peer]
                self.theirs.pop(peer, None)  # what it has is no one's to wait for now
                self.spent.pop(peer, None)
            self.changed.set()

    async def _from_peer_again(self, peer: str) -> None:
        failures = 0
        while self.missing and self.refused is None:
            stopped = await self._from_peer(peer)
            if stopped is None:
                return
            failures += 1
            broken = isinstance(stopped, (NetworkError, ConnectionError, OSError, TimeoutError))  # not a refusal
            if not broken or peer not in self.coming or peer in self.wrong_peers() or failures > COMING_FAILURES:
                logger.info("Fetching pieces of %s from %s stopped: %s", self.program_hash[:12], peer[-8:], stopped)
                return
            await asyncio.sleep(NOT_YET_RETRY * min(failures, 4))

    def wrong_peers(self) -> set[str]:
        return self.convicted.union(*self.wrong.values())

    async def _from_peer(self, peer: str) -> Exception | None:
        """One go at :meth:`from_peer`; what stopped it, if it failed (None: done, or nothing more to ask it)."""
        index = writer = None
        failed_opens = busy = 0
        seen: set[int] = set()
        try:
            # A stream is held only while there is a piece to ask for: an idle one would hold the holder's place.
            while (index := await self._next(peer)) is not None:
                try:
                    reader, writer = await self.fetcher.rpc.open(peer, Door.PIECE)  # by id: no address of the client's
                except NetworkError as e:
                    self._give_back(index)
                    index = None
                    failed_opens += 1
                    if failed_opens > OPEN_RETRIES:
                        raise _Unreachable(str(e)) from None  # gone: not asked again (a broken stream is)
                    await asyncio.sleep(NOT_YET_RETRY)
                    continue
                failed_opens = 0  # failures in a row: a long wait for a busy holder may meet a few, spread out
                try:
                    while index is not None:
                        ok = await self._one(peer, reader, writer, index, seen)
                        index = None
                        busy = 0
                        if not ok:
                            return
                        index = self._take(peer)
                    writer.close()
                    writer = None
                except _Busy:
                    self._give_back(index)
                    index = None
                    writer.close()
                    writer = None
                    # Busy (serving others, or an older holder still getting it) for too long, from a holder the
                    # client does not vouch for. One it vouches for is asked again while the swarm moves (fetch).
                    waited = time.monotonic() - self.progress.get(peer, self.started)
                    if peer not in self.coming and waited > BUSY_PATIENCE:
                        return
                    busy += 1
                    await asyncio.sleep(min(NOT_YET_RETRY * 2 ** min(busy - 1, 4), BUSY_BACKOFF))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # whatever a broken peer (or a peer id nobody answers for) makes us trip on
            return e
        finally:
            if index is not None:
                self._give_back(index)  # someone else's to fetch
            if writer is not None:
                writer.close()
        return None

    async def _one(self, peer: str, reader, writer, index: int, seen: set[int]) -> bool:
        """Fetch piece ``index`` from ``peer``; False when this peer should not be asked for more. ``seen``: the
        pieces it said it has on this stream."""
        start, length = self.pieces.span(index)
        await protocol.write(writer, GetPiece(self.program_hash, index, self.pieces.piece_size, self.grants.get(peer),
                                              have=True, sent=True))
        reply = await protocol.read(reader, PieceData, Error, Have, timeout=protocol.FRAME_TIMEOUT + HAVE_WAIT)
        if isinstance(reply, Have):  # not there yet (or sent on already): asked again for what it has, or later
            if peer not in self.coming:  # records said it holds the program: busy, as far as patience goes
                raise _Busy()
            went = index in reply.sent_indices() and index in reply.indices()  # the fetchers that have it send it
            self._account(peer, reply, seen, lacks=None if went else index)
            self.declined[peer] = index
            self._give_back(index)
            return True
        if isinstance(reply, Error):
            error = reply.exception()
            if isinstance(error, WorkerBusy):
                raise _Busy()
            raise error  # not cached (any more) there, or refused: ask the others
        if reply.have is not None and peer in self.coming:  # a copy still coming: what it has, with the piece
            self._account(peer, Have(reply.have, reply.sent), seen)
        elif peer in self.theirs:  # its copy is whole now: anything may be asked of it
            self.theirs.pop(peer, None)
            self.spent.pop(peer, None)
        if reply.size != length:
            raise protocol.ProtocolError(f"piece {index} of {reply.size} bytes; it has {length}")
        data = await protocol.read_payload(reader, length, length, "piece", timeout=protocol.payload_deadline(length))
        if index not in self.missing or self.refused is not None:  # another peer delivered it meanwhile
            return True
        if not await asyncio.to_thread(self.pieces.matches, index, data):  # overlaps the other stream's transfer
            logger.warning("Peer %s served a corrupted piece %d of program %s; fetching it elsewhere", peer[-8:],
                           index, self.program_hash[:12])
            self.wrong.setdefault(index, set()).add(peer)
            self._give_back(index)
            return False
        if self.refused is not None:  # refused while this piece was being checked
            return False
        if self.buffer is None:
            try:
                if self.on_first is not None:
                    self.on_first()
                self.buffer = program_buffer(self.pieces.size, self.fetcher.spool_dir)
            except Exception as e:  # no room for it now (charged once: the fetch ends, every stream with it)
                self.refused = e
                self.changed.set()
                return False
        if index not in self.missing:  # delivered by another stream while this one waited for the check
            return True
        self.buffer[start:start + length] = data
        self.missing.discard(index)
        self.sources.add(peer)
        self.progress[peer] = self.moved = time.monotonic()
        self.convicted |= self.wrong.pop(index, set())  # this digest is matched, so their copy was wrong
        self.changed.set()
        return True
