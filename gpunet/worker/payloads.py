"""What a job lacks, read from where it comes: the stream door asks the client (or the peers it names) for the
program and inputs and reads them, capped and charged before a byte is read; the unary door has only what came
inline. Big streamed inputs and programs are spooled to an unlinked file (at least gpunet.worker.spool.SPOOL_BYTES),
so they reach the executor as page cache."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import tempfile
from dataclasses import dataclass
from typing import Callable

from gpunet import protocol
from gpunet.errors import ProtocolError
from gpunet.protocol import FRAME_TIMEOUT, MAX_TENSORS_ASKED, Payload, Pieces, Send, Submit, TensorHolders
from gpunet.utils import sha256_hex
from gpunet.worker.peers import Fetcher, hash_and_key
from gpunet.worker.spool import SPOOL_BYTES, Spooled, SpooledProgram, program_buffer
from gpunet.worker.state.limits import ServiceLimits

logger = logging.getLogger(__name__)


#: The longest weights named by reference are fetched from the workers the client named before the client is asked.
TENSORS_FROM_PEERS_SECONDS = 120.0
#: Weights asked of the client again are first looked for at the workers it sends them to (Send.again) only while at
#: least this long is left of the time for peers.
AGAIN_LEAST_SECONDS = 5.0


#: Where a job's program came from (``Inputs.origin``): its client's own bytes, peers the client named (the
#: client's proof of holding then checked against them), or another job's copy on its way in.
FROM_CLIENT, FROM_PEERS, FROM_COPY = "client", "peers", "copy"


@dataclass
class Inputs:
    """A job's bytes once here: its program (None: the worker holds it), its inputs, and their hash."""

    program: bytes | bytearray | SpooledProgram | None
    inputs: "bytes | bytearray | Spooled"
    input_hash: str
    origin: str | None = None  # where the program came from (FROM_*), when it came with the job
    key: bytes | None = None  # FROM_PEERS: the program's holding key (gpunet.protocol.holding), from the bytes

    def release(self) -> None:
        """Let go of the payload now (a failure's traceback keeps the job's frame, and its future the failure): an
        abandoned upload's memory is freed now, not whenever the cycle collector runs."""
        if isinstance(self.inputs, bytearray):
            try:
                self.inputs.clear()
            except BufferError:  # still viewed somewhere (never by us once the job is over): it goes with its view
                pass
        elif isinstance(self.inputs, Spooled):
            self.inputs.close()  # unlinked already: closing gives the disk space back


class Receiving:
    """A program's bytes as they arrive from the client, in one buffer of its declared size (charged already; a spooled
    file when it is big: gpunet.worker.spool): what has come so far can be served to other workers meanwhile
    (Upload.piece)."""

    def __init__(self, size: int, spool_dir: str | None = None):
        self.buffer = program_buffer(size, spool_dir)
        self.received = 0

    def write(self, chunk) -> None:
        n = len(chunk)
        self.buffer[self.received:self.received + n] = chunk
        self.received += n

    def flush(self) -> None:
        pass

    def piece(self, start: int, length: int) -> bytes | None:
        end = min(start + length, len(self.buffer))
        return bytes(self.buffer[start:end]) if end <= self.received else None

    def here(self) -> int:
        return self.received

    def have(self, piece_size: int) -> set[int]:
        whole = self.received // piece_size + (self.received == len(self.buffer) and self.received % piece_size > 0)
        return set(range(whole))


class NeedsStream(Exception):
    """The unary door cannot take this job (program or inputs must be sent): the client switches to the stream."""


class StreamPayloads:
    """Asks the client for what the worker lacks (program, inputs) and reads it, capped, from the stream. A program
    may come from peers instead (``fetcher``): the client then sends who holds it and each piece's digest."""

    def __init__(self, reader, writer, limits: ServiceLimits, spool_dir: str | None = None,
                 fetcher: "Fetcher | None" = None, proves: Callable[[bytes, bytes | None], bool] | None = None):
        """``proves(key, proof)``: whether a proof of holding is this client's for this worker (a program fetched from
        peers runs for it only then; None: fetch from no peer)."""
        self.reader, self.writer, self.limits, self.spool_dir = reader, writer, limits, spool_dir
        self.fetcher, self.proves = fetcher, proves

    def precheck(self, submit: Submit, need_program: bool) -> None:
        pass  # the stream can carry anything

    async def fetch(self, submit: Submit, need_program: bool, charge: Callable[[int], None], sink=None) -> Inputs:
        """``sink``: the Upload the program comes in as (served to other workers as it arrives)."""
        need_inputs = submit.inputs is None
        if not (need_program or need_inputs):
            return Inputs(None, submit.inputs, sha256_hex(submit.inputs))
        from_peers = need_program and self.fetcher is not None and self.proves is not None and not submit.private
        await protocol.write(self.writer, Send(need_program, need_inputs, pieces=from_peers))
        reply = await protocol.read(self.reader, Payload, Pieces, timeout=FRAME_TIMEOUT) if from_peers else \
            await protocol.read(self.reader, Payload, timeout=FRAME_TIMEOUT)
        pieces = reply if isinstance(reply, Pieces) else None
        if pieces is not None:
            payload = await protocol.read(self.reader, Payload, timeout=FRAME_TIMEOUT)
            if payload.program_size is not None:
                raise ProtocolError("a client that named holders of the program must not send it as well")
        else:
            payload = reply
        if need_inputs and payload.inputs_size != submit.inputs_size:
            raise ProtocolError("inputs payload size differs from the size the submit declared")
        # Every declared size is checked against its cap and charged to the worker's buffer before a byte is read.
        protocol.check_payload_size(submit.inputs_size if need_inputs else 0, self.limits.max_input_bytes, "inputs")
        program_size = pieces.size if pieces is not None else payload.program_size
        if need_program:
            protocol.check_payload_size(program_size, self.limits.max_program_bytes, "program")
        # A program from peers is charged once its first piece is here (or before the client sends it after all):
        # holders a client names may never deliver, and waiting for them must not hold the budget.
        charge((submit.inputs_size if need_inputs else 0) + (program_size if need_program and pieces is None else 0))
        if pieces is not None:
            charge(program_size, dry=True)  # one that could never fit, or no room now: said before waiting on peers
        program = key = None
        if need_program and pieces is None:
            program = await self._read_program(program_size, sink, payload.token, private=submit.private)
        inputs = await self._read_inputs(submit) if need_inputs else None
        origin = FROM_CLIENT if need_program else None
        if pieces is not None:
            program, key = await self._from_peers(submit, pieces, charge, sink)
            origin = FROM_PEERS if key is not None else FROM_CLIENT
        if not need_inputs:
            inputs = Inputs(None, submit.inputs, sha256_hex(submit.inputs))
        inputs.program, inputs.origin, inputs.key = program, origin, key
        return inputs

    async def _from_peers(self, submit: Submit, pieces: Pieces, charge: Callable[[int], None], sink=None
                          ) -> tuple[bytes | bytearray, bytes | None]:
        """The program from the peers the client named (every piece checked, then the whole against its hash) with
        its holding key, else from the client after all (and no key). Holders are reached by their peer id, never at
        an address the client gave. ``charge``: the budget, charged the program's size once, when its bytes start to
        come (from a peer, or from the client)."""
        charged = False

        def first_piece() -> None:
            nonlocal charged
            charge(pieces.size)
            charged = True

        runs = []

        def serve(run) -> None:  # what it has fetched so far is served to other workers meanwhile
            runs.append(run)
            if sink is not None:
                sink.receiving(pieces.size, run, pieces.token)

        # At most half the job's time (the client then still has the rest to send it), and no longer than the client
        # stays: it sends nothing until our answer, so any byte or EOF from it means it hung up.
        fetched = await self._while_client_stays(self.fetcher.fetch(
            submit.program, pieces.piece_list(), pieces.holder_ids, submit.timeout / 2, coming=pieces.coming,
            on_first=first_piece, grants=dict(pieces.grants), serve=serve, token=pieces.token), "the program")
        run = runs[0] if runs else None
        if fetched is None and run is not None and run.buffer is not None and run.missing and run.refused is None:
            fetched = await self._rest_from_client(submit, pieces, run, sink)  # only what the peers did not deliver
        # The bytes run for this client only if it proves it holds them (older holders serve anyone who knows a hash
        # and its piece list); otherwise, as when the peers fail, it sends them itself (an older client does).
        if fetched is not None and (fetched[1] is None or self.proves(fetched[1], pieces.holds or submit.holds)):
            return fetched  # a bytearray, not copied: the executor takes any bytes-like program
        if run is not None:  # what the peers delivered goes: the client's copy takes its place (and its charge)
            run.buffer = None
        fetched = run = None
        runs.clear()
        if not charged:
            charge(pieces.size)  # WorkerBusy if there is no room for it now: the client hears so
        await protocol.write(self.writer, Send(True, False))
        payload = await protocol.read(self.reader, Payload, timeout=FRAME_TIMEOUT)
        if payload.program_size != pieces.size or payload.inputs_size is not None:
            raise ProtocolError("the program sent differs in size from the one the piece list describes")
        return await self._read_program(payload.program_size, sink, payload.token or pieces.token), None

    async def _rest_from_client(self, submit: Submit, pieces: Pieces, run, sink=None
                                ) -> tuple[bytearray, bytes | None] | None:
        """The pieces the peers did not deliver, from the client, into the fetch's buffer (each checked against the
        client's own piece list; served on to other workers as they land), and the program's holding key; an older
        client sends the whole program instead (no key: it came from the client). None: the assembled bytes do not
        hash to the program (the client then sends it whole)."""
        listed = pieces.piece_list()
        want = sorted(run.missing)
        spans = [listed.span(i) for i in want]
        total = sum(length for _, length in spans)
        await protocol.write(self.writer, Send(True, False, missing=tuple(want)))
        payload = await protocol.read(self.reader, Payload, timeout=FRAME_TIMEOUT)
        if payload.inputs_size is not None:
            raise ProtocolError("the client sent inputs it was not asked for")
        if payload.program_size == pieces.size and total != pieces.size:  # an older client: all of it, in place of
            run.buffer = None  # what the peers delivered (charged once)
            return await self._read_program(payload.program_size, sink, payload.token or pieces.token), None
        if payload.program_size != total:
            raise ProtocolError("the pieces sent differ in size from the pieces asked for")
        for index, (start, length) in zip(want, spans):
            data = await protocol.read_payload(self.reader, length, length, "program piece",
                                               timeout=protocol.payload_deadline(length))
            if not listed.matches(index, data):
                raise ProtocolError(f"the client sent piece {index} of its program unlike its own piece list")
            run.buffer[start:start + length] = data
            run.missing.discard(index)
        found, key = await asyncio.to_thread(hash_and_key, run.buffer)
        if found != submit.program:
            logger.warning("Program %s assembled from peers and its client does not match its hash; asking the client "
                           "for all of it", submit.program[:12])
            return None
        return run.buffer, key

    async def fetch_tensors(self, wanted: list, store, timeout: float = TENSORS_FROM_PEERS_SECONDS) -> None:
        """Weights the program names by reference that the worker found nowhere else, from the client (``wanted``:
        WeightRefs, each sha256 once): each streamed into the tensor store, hashed on the way in; one wrong byte is
        the client's ProtocolError, and nothing of that tensor is kept. A client that names workers keeping their
        checkpoint instead (TensorHolders) sends only what those do not deliver within ``timeout``; asked again
        while time is left, it may first name the workers it began sending those to meanwhile (``Send.again``), which
        get what is left of ``timeout``, then it sends the rest."""
        loop = asyncio.get_running_loop()
        for start in range(0, len(wanted), MAX_TENSORS_ASKED):
            chunk = wanted[start:start + MAX_TENSORS_ASKED]
            # Asked of the client, they come from it (peers asking here wait), unless it names holders.
            store.expect((r.sha256 for r in chunk), store.CLIENT)
            await protocol.write(self.writer, Send(False, False, tensors=tuple(r.sha256 for r in chunk)))
            reply = await protocol.read(self.reader, Payload, TensorHolders, timeout=FRAME_TIMEOUT)
            deadline = loop.time() + timeout  # for peers, in all: a peer that keeps saying "busy" costs no more
            for again in (True, False):
                if not isinstance(reply, TensorHolders):
                    break
                store.expect((r.sha256 for r in chunk), store.PEERS)  # other workers have them: what they deliver
                if self.fetcher is not None:
                    chunk = await self._from_holders(chunk, reply, store, max(0.0, deadline - loop.time()))
                if not chunk:
                    break
                again = again and self.fetcher is not None and deadline - loop.time() >= AGAIN_LEAST_SECONDS
                store.expect((r.sha256 for r in chunk), store.CLIENT)
                await protocol.write(self.writer, Send(False, False, tensors=tuple(r.sha256 for r in chunk),
                                                       again=again))
                reply = await protocol.read(self.reader, *((Payload, TensorHolders) if again else (Payload,)),
                                            timeout=FRAME_TIMEOUT)
            if not chunk:
                continue
            if (reply.tensors_size != sum(r.nbytes for r in chunk) or reply.program_size is not None
                    or reply.inputs_size is not None):
                raise ProtocolError("the weights sent differ in size from those asked for")
            for r in chunk:
                await self._read_tensor(r, store)
                store.granted(r.sha256, reply.token)  # whom its client grants it to may fetch it from here
            logger.info("Received %d weight(s) (%d bytes) from the client", len(chunk), reply.tensors_size)

    async def _from_holders(self, wanted: list, named: TensorHolders, store, timeout: float) -> list:
        """What the holders the client named deliver; the rest, to ask it for."""
        return await self._while_client_stays(self.fetcher.fetch_tensors(
            wanted, named.holders, store, timeout, dict(named.grants), named.token), "the weights")

    async def _while_client_stays(self, work, what: str):
        """``work`` (a fetch from peers), no longer than the client stays: it sends nothing until our answer, so any
        byte or EOF from it means it hung up."""
        fetch = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(self.reader.read(1))
        try:
            await asyncio.wait([fetch, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not fetch.done():
                fetch.cancel()
            gone.cancel()
            # Both settled before the stream is read again: a read still pending would refuse the next one, or
            # take the first byte of the client's next frame.
            await asyncio.gather(fetch, gone, return_exceptions=True)
        if not gone.cancelled():  # EOF, or a byte the client had no business sending yet
            raise ProtocolError(f"the client hung up while {what} was being fetched from peers")
        return fetch.result()

    async def _read_tensor(self, ref, store) -> None:
        hasher = hashlib.sha256()
        with store.incoming(ref.sha256) as tmp:
            await protocol.read_payload(self.reader, ref.nbytes, self.limits.max_program_bytes, f"weight {ref.name}",
                                        hasher, timeout=protocol.payload_deadline(ref.nbytes), into=tmp)
            if hasher.hexdigest() != ref.sha256:
                raise ProtocolError(f"the client sent weight {ref.name} with bytes that do not match its hash")

    async def _read_program(self, size: int, sink=None, token: bytes | None = None, private: bool = False
                            ) -> bytes | bytearray | SpooledProgram:
        """The program's bytes from the client; with a ``sink`` (its Upload), served to other workers as they come.
        A big one is spooled to a file unless ``private`` (a private program's weights never touch the disk)."""
        timeout = protocol.payload_deadline(size if size is not None else 0)
        if sink is None:
            return bytes(await protocol.read_payload(self.reader, size, self.limits.max_program_bytes, "program",
                                                     timeout=timeout))
        protocol.check_payload_size(size, self.limits.max_program_bytes, "program")
        coming = Receiving(size, None if private else self.spool_dir)
        sink.receiving(size, coming, token, seeding=True)
        await protocol.read_payload(self.reader, size, self.limits.max_program_bytes, "program", timeout=timeout,
                                    into=coming)
        return coming.buffer  # a bytearray, not copied: the executor takes any bytes-like program

    async def _read_inputs(self, submit: Submit) -> Inputs:
        hasher = hashlib.sha256()
        deadline = protocol.payload_deadline(submit.inputs_size)
        if self.spool_dir is not None and submit.inputs_size >= SPOOL_BYTES:
            spooled = Spooled(tempfile.TemporaryFile(dir=self.spool_dir), submit.inputs_size)
            try:
                await protocol.read_payload(self.reader, submit.inputs_size, self.limits.max_input_bytes, "inputs",
                                            hasher, timeout=deadline, into=spooled.file)
            except BaseException:
                spooled.close()
                raise
            return Inputs(None, spooled, hasher.hexdigest())
        inputs = await protocol.read_payload(self.reader, submit.inputs_size, self.limits.max_input_bytes, "inputs",
                                             hasher, timeout=deadline)
        return Inputs(None, inputs, hasher.hexdigest())  # a bytearray: no second copy of a large input


class UnaryPayloads:
    """The unary door has only what came inline: anything missing sends the client to the stream door."""

    def precheck(self, submit: Submit, need_program: bool) -> None:
        if need_program or submit.inputs is None:
            raise NeedsStream()

    async def fetch(self, submit: Submit, need_program: bool, charge: Callable[[int], None], sink=None) -> Inputs:
        return Inputs(None, submit.inputs, sha256_hex(submit.inputs))

    async def fetch_tensors(self, wanted: list, store, timeout: float = 0.0) -> None:
        raise NeedsStream()
