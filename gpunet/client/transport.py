"""How a job reaches a worker: the client's side of the doors in :mod:`gpunet.protocol`. Moves bytes, decides nothing.

Routing (:mod:`gpunet.client.routing`) decides *who*; a transport decides *how*: the unary door (one round
trip, countersignatures owed to that worker riding along) for a small job whose program the worker should hold, the
same exchange over a ``steps`` stream kept open for a session's steps (no stream set up in the daemons per step),
the stream door (any size, the program sent if asked) otherwise or when the worker says so. Everything the network can
throw (the daemon's errors, ``ConnectionError``, ``OSError``) leaves a transport as a :class:`~gpunet.GpunetError`.

:class:`BaseTransport` declares all the client asks of one. :class:`P2PTransport` is the real one over hivemind;
``ClientCore(transport=...)`` takes any other (:class:`gpunet.testing.transport.FakeTransport` runs workers
in-process, so retries, bans and verification are checked without go-libp2p).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Sequence

from gpunet import protocol
from gpunet.client.jobs import MAX_OUTPUT_BYTES, Delivery, JobRequest, Verdict
from gpunet.errors import GpunetError, ProtocolError, WeightsNotHeld
from gpunet.ledger.receipts import Receipt
from gpunet.protocol.peers import PieceList
from gpunet.protocol import (
    INLINE_BYTES,
    PIECE,
    RUN,
    STEPS_REUSE,
    UNARY_OUTPUT_BYTES,
    Cancel,
    CloseSession,
    SessionClosed,
    Door,
    Error,
    Ok,
    OpenProof,
    Payload,
    Pieces,
    ProofOpening,
    ProveSpeed,
    Result,
    Send,
    SettleBatch,
    SpeedCommitment,
    Submit,
    TensorHolders,
    UseStream,
    holding_key,
    proof,
)
from gpunet.client.stepgroups import StepGroups
from gpunet.utils import LRU

if TYPE_CHECKING:
    from gpunet.client.settlement import Settlement
    from gpunet.dht.records import WorkerEntry
    from gpunet.identity import Identity
    from gpunet.rpc import RPC

logger = logging.getLogger("gpunet.client")


class BaseTransport(ABC):
    """Everything the client asks of a way to reach workers. :class:`P2PTransport` is the real one;
    :class:`gpunet.testing.transport.FakeTransport` runs workers in-process. Raises only GpunetErrors."""

    #: Workers pass a session step's output on to the next span's worker (``SessionStep.push_to``).
    pushes: bool = False
    #: It sends speed challenges (:meth:`prove`, :meth:`open_proof`); without, routing takes claimed speeds as they are.
    proves: bool = False
    #: Program bytes uploaded to workers, in all: what workers fetching programs from each other spare this link.
    program_bytes_sent: int = 0

    @abstractmethod
    async def discover(self) -> list["WorkerEntry"]:
        """The workers' records live now, tombstones included (state OFFLINE: a worker that said it left), so that
        the view can tell a worker gone from one a look missed."""

    @abstractmethod
    async def submit(self, worker: "WorkerEntry", request: JobRequest, *, cached: bool,
                     settlement: "Settlement") -> Delivery:
        """Run ``request`` on ``worker``; ``cached``: the worker should hold the program. Raises WorkerBusy,
        JobRejected, JobFailed, JobTimeout, ProgramNotCached, ProtocolError or NetworkError."""

    @abstractmethod
    async def settle(self, worker_id: str, items: Sequence[tuple[str, bytes]]) -> None:
        """Countersignatures for results received through the unary door, in one call."""

    @abstractmethod
    async def cancel(self, worker_id: str, job_id: str) -> bool:
        """Ask a worker to stop a job; True if it was still queued or running."""

    @abstractmethod
    async def close_session(self, worker_id: str, session_id: str, received: int | None = None) -> Delivery | None:
        """End one of our sessions on a worker: the receipt of its steps not billed yet (None when there are none)."""

    @abstractmethod
    async def close(self) -> None: ...

    def forget(self, worker_id: str) -> None:
        """A worker that failed or left is named to no other as a program's holder (none are, by default)."""

    async def prove(self, worker_id: str, challenge: ProveSpeed) -> tuple[SpeedCommitment, float]:
        """A speed challenge (only where :attr:`proves`): the worker's commitment and the seconds it took."""
        raise NotImplementedError

    async def open_proof(self, worker_id: str, request: OpenProof) -> ProofOpening:
        raise NotImplementedError


def _tensor_rounds(request: JobRequest) -> int:
    """How many Sends for weights a job may take: one per MAX_TENSORS_ASKED it names (0 for a job naming none)."""
    n = request.weights_named
    return -(-n // protocol.MAX_TENSORS_ASKED) if n else 0


def _pieces_of(program: bytes, indices: tuple[int, ...], worker_id: str) -> list[memoryview]:
    """The program's pieces at ``indices`` (of the piece size its size implies), as a worker asks for them."""
    piece = protocol.piece_size_for(len(program))
    if indices[-1] * piece >= len(program):
        raise ProtocolError(f"worker {worker_id[-8:]} asked for piece {indices[-1]} of a program of "
                            f"{-(-len(program) // piece)} pieces")
    view = memoryview(program)
    return [view[i * piece:(i + 1) * piece] for i in indices]


def _inline_submit(request: JobRequest, settle: Sequence[tuple[str, bytes]], holds: bytes | None) -> Submit:
    """A job whose inputs ride in its Submit (the run door's, a steps stream's)."""
    return Submit(request.job_id, request.program_hash, len(request.inputs), request.inputs, request.timeout,
                  request.max_price, tuple(settle), private=request.private, shared=request.shared, holds=holds,
                  session=request.session, lane=request.lane, deadline=request.deadline)


def _receipt(data: bytes, request: JobRequest) -> Receipt | None:
    """A result's receipt; only a session step may come without one (its session's tab bills it)."""
    if not data and request.session is not None:
        return None
    return Receipt.from_bytes(data)


#: How long holders a worker could not fetch a program from, named only by their records, are not named again.
UNHELPFUL_SECONDS = 300.0
#: Programs at least this big have their holding key computed in a thread (one pass over the program, once).
KEY_IN_THREAD_BYTES = 1 << 20
#: Idle ``steps`` streams kept per worker (one per session stepping there at once is what is used).
IDLE_STEP_STREAMS = 8
#: How long a verdict written on a job's stream waits for the worker to say it filed it (then it goes by the settle
#: door).
VERDICT_ACK_TIMEOUT = 10.0
#: A weight's mark on a stream once the worker was pointed at other workers for it twice: the next ask gets bytes.
_ASKED_AGAIN = 1 << 62


class P2PTransport(BaseTransport):
    """Jobs over hivemind's p2p daemon, as this client's own DHT node (a client: it serves no records)."""

    pushes = True
    proves = True

    def __init__(self, dht, rpc: "RPC", peer_id: str | None = None):
        """``peer_id``: this client's own (what its proofs of holding name as the prover; None: it proves nothing,
        and sends a program whenever a worker asks for it)."""
        self.dht, self.rpc, self.peer_id = dht, rpc, peer_id
        # (worker, program) -> resolves once the job that went first with that program to that worker no longer
        # needs the link for it (the worker had it, or the upload is written, or that job failed)
        self._first_with_program: dict[tuple[str, str], asyncio.Future] = {}
        # program -> the workers this client is sending it to now (id -> addresses): holders-to-be, which a worker
        # that also lacks it may fetch it from once they have it
        self._receiving: dict[str, dict[str, tuple[str, ...]]] = {}
        # program -> workers that ran it for this client (they keep it on disk and serve it to peers): known holders
        # before any record of theirs says so, so a replica asking after the first copy's job ended still fetches it
        # from a peer instead of taking a second copy over this client's link
        self._ran: LRU[str, dict[str, tuple[str, ...]]] = LRU(64)
        self._piece_lists: LRU[str, asyncio.Future] = LRU(32)  # program -> its PieceList, being hashed or done
        self._keys: LRU[str, asyncio.Future] = LRU(32)  # program -> its holding key, being hashed or done
        # program -> holders only records vouched for, which a worker told of them then asked us for the program
        # after all: not named again for UNHELPFUL_SECONDS (records claiming a popular program, answering "busy",
        # cost every fetch its patience)
        self._unhelpful: LRU[str, dict[str, float]] = LRU(64)
        self.program_bytes_sent = 0  # programs uploaded to workers, in all (what peers spare this client's link)
        self.weight_bytes_sent = 0  # of those, weights programs name by reference (what models dirs spare it)
        self._tokens: LRU[str, bytes] = LRU(4096)  # upload tokens, by program (see _upload_token)
        # Per program, the workers this client sent the weights it names by reference, or pointed at holders of them.
        self._weights_at: LRU[str, dict[str, bool]] = LRU(4096)
        # Per program, the workers this client sends (or sent) weights' bytes to: worker -> weight -> when its send
        # began (counted in _weights_sends). A worker asking again is pointed at those whose send of one of the
        # weights it asks for began after its first ask.
        self._weights_to: LRU[str, dict[str, dict[str, int]]] = LRU(4096)
        self._weights_sends = 0
        from gpunet.rpc import KeptStreams  # (here: importing this module must not import hivemind)

        self.steps = KeptStreams(rpc, Door.STEPS, STEPS_REUSE, per_peer=IDLE_STEP_STREAMS)  # session steps
        self.step_groups = StepGroups(self.steps)  # several sessions' steps to one worker at once: one frame

    @classmethod
    async def connect(cls, network: str, initial_peers: Sequence[str], identity: "Identity") -> "P2PTransport":
        from gpunet.dht import network as net
        from gpunet.rpc import RPC

        dht = await asyncio.to_thread(net.join_as_client, network, initial_peers, identity)
        try:
            return cls(dht, RPC(await dht.replicate_p2p(), network), identity.peer_id)
        except BaseException:
            dht.shutdown()
            raise

    async def discover(self) -> list["WorkerEntry"]:
        from gpunet.dht import registry

        return await registry.discover_async(self.dht, self.rpc.network, include_offline=True)

    async def close(self) -> None:
        self.step_groups.close()
        self.steps.close()
        await self.rpc.close()
        try:
            await asyncio.to_thread(self.dht.shutdown)
        except RuntimeError:  # at interpreter exit no new threads may start: shut it down from here
            self.dht.shutdown()

    # --- jobs ------------------------------------------------------------------------------------------------------

    async def submit(self, worker: "WorkerEntry", request: JobRequest, *, cached: bool,
                     settlement: "Settlement") -> Delivery:
        # Held until it fits under the worker's credit line (paying as it goes, this client is never refused there).
        async with settlement.paced(worker.id) as slot:
            return await self._submit(worker, request, cached, settlement, slot)

    async def _submit(self, worker: "WorkerEntry", request: JobRequest, cached: bool, settlement: "Settlement",
                      slot: int) -> Delivery:
        try:
            # The unary door answers in one round trip, but carries at most UNARY_OUTPUT_BYTES back: a job known to
            # answer more goes by stream at once (a worker that kept such a result for a stream retry could not keep
            # one over its client's share of kept results).
            # A worker holding the program runs it for this client if it sent it there, or on this proof that it
            # holds the bytes (gpunet.protocol.holding): the hash alone is no capability.
            # (Believed cold, it goes along if its key is known already: records can be stale, and a proof is cheaper
            # than an upload.)
            holds = await self.holds(worker.id, request) if cached else self._holds_known(worker.id, request)
            if len(request.inputs) <= INLINE_BYTES and cached and request.max_output_bytes <= UNARY_OUTPUT_BYTES:
                owed = settlement.take(worker.id, slot)
                try:
                    if request.session is not None:
                        delivery = await self.run_step(worker.id, list(worker.record.maddrs), request, settle=owed,
                                                       holds=holds)
                    else:
                        delivery = await self.run_unary(worker.id, request, settle=owed, holds=holds)
                except _UseStream:
                    settlement.delivered(owed)  # they rode along; the worker took them before answering
                except BaseException as e:
                    settlement.give_back(worker.id, owed)  # not delivered: owe them still
                    if isinstance(e, asyncio.CancelledError):  # cancelled or timed out: the worker can stop work on it
                        settlement.track(self.cancel(worker.id, request.job_id))
                    raise
                else:
                    settlement.delivered(owed)
                    return delivery
            if cached:
                return await self.run_stream(worker.id, list(worker.record.maddrs), request, holds=holds)
            return await self._run_stream_once_per_program(worker, request, holds)
        except GpunetError:
            raise
        except (ConnectionError, OSError) as e:  # the worker's connection, unless our own daemon went
            raise await self.rpc.failure(f"worker {worker.id[-8:]}: {type(e).__name__}: {e}") from None
        except Exception as e:  # whatever a broken or hostile worker makes us trip on: its fault, not the job's
            raise ProtocolError(f"worker {worker.id[-8:]} sent an answer that cannot be read ({type(e).__name__})"
                                ) from None

    async def run_unary(self, worker_id: str, request: JobRequest, settle: Sequence[tuple[str, bytes]] = (),
                        holds: bytes | None = None) -> Delivery:
        """One round trip over the daemon's persistent connection, for a small job whose program the worker holds.

        ``settle`` carries countersignatures still owed to this worker, so steady traffic needs no separate settle
        calls. Raises _UseStream when the worker wants the stream door instead. ``holds``: this client's proof that
        it holds the program (:meth:`holds`), for a worker that may hold a copy this client did not send it.
        """
        submit = _inline_submit(request, settle, holds)
        reply = await self.rpc.call(worker_id, Door.RUN, submit, Result, UseStream, Error)
        if isinstance(reply, Result) and reply.outputs is None:
            raise ProtocolError("a unary result must carry its outputs")
        return self._delivered(worker_id, request, reply)

    def _delivered(self, worker_id: str, request: JobRequest, reply: Result | UseStream | Error) -> Delivery:
        """What the run door's (or a steps stream's) answer delivers; its countersignature goes by the settle door or
        rides on a later job."""
        if isinstance(reply, UseStream):
            raise _UseStream()
        if isinstance(reply, Error):
            raise reply.exception()
        receipt = _receipt(reply.receipt, request)

        async def finish(verdict: Verdict) -> None:
            await self.rpc.call(worker_id, Door.SETTLE, verdict, Ok, Error)

        return Delivery(worker_id, reply.outputs, receipt, len(request.inputs), 0.0, via_unary=True, finish=finish,
                        input_hash=reply.input_hash)

    async def run_step(self, worker_id: str, maddrs: Sequence[str], request: JobRequest,
                       settle: Sequence[tuple[str, bytes]] = (), holds: bytes | None = None) -> Delivery:
        """A session step as :meth:`run_unary` sends it, over a ``steps`` stream to the worker kept open between steps
        (:meth:`~gpunet.rpc.KeptStreams.exchange_or`: a unary call costs the p2p daemons a stream set up each time);
        by the run door to a worker without that door, or when the step is too big for a frame."""
        async def answer(reader: asyncio.StreamReader) -> Result | UseStream | Error:
            reply = await protocol.read(reader, Result, UseStream, Error)
            if isinstance(reply, Result) and reply.outputs is None:  # bigger than a frame: after it
                cap = min(request.max_output_bytes, MAX_OUTPUT_BYTES)
                reply = dataclasses.replace(reply, outputs=bytes(
                    await protocol.read_payload(reader, reply.outputs_size, cap, "outputs")))
            return reply

        async def unary() -> Delivery:
            return await self.run_unary(worker_id, request, settle, holds)

        submit = _inline_submit(request, settle, holds)
        grouped = await self.step_groups.send(worker_id, maddrs, submit)  # with other sessions' steps, if any
        if isinstance(grouped, (Result, Error)):
            return self._delivered(worker_id, request, grouped)
        reply = await self.steps.exchange_or(worker_id, maddrs, submit, answer, unary)
        return reply if isinstance(reply, Delivery) else self._delivered(worker_id, request, reply)

    async def _run_stream_once_per_program(self, worker: "WorkerEntry", request: JobRequest,
                                           holds: bytes | None = None) -> Delivery:
        """A job for a program the worker may lack: the first such job to that worker goes at once (and carries the
        program if asked); the others wait until the program has crossed, so this client never sends a second copy
        of a program to a worker it is already sending it to. Should the first fail, they go anyway."""
        key = (worker.id, request.program_hash)
        first = self._first_with_program.get(key)
        if first is not None:
            await asyncio.shield(first)
            return await self.run_stream(worker.id, list(worker.record.maddrs), request, holds=holds)
        crossed = self._first_with_program[key] = asyncio.get_running_loop().create_future()
        try:
            return await self.run_stream(worker.id, list(worker.record.maddrs), request, program_crossed=crossed,
                                         holds=holds)
        finally:
            if not crossed.done():
                crossed.set_result(None)
            del self._first_with_program[key]

    async def run_stream(self, worker_id: str, maddrs: Sequence[str], request: JobRequest,
                         program_crossed: asyncio.Future | None = None, holds: bytes | None = None) -> Delivery:
        """The stream door: any size; sends the program when the worker asks for it. ``program_crossed`` resolves
        once the worker holds the program or has been sent it (before the job's own result comes); ``holds``: as
        for :meth:`run_unary`."""
        reader, writer = await self.rpc.open(worker_id, Door.JOB, maddrs)
        ran = False  # it answered with a result: it holds the program now
        try:
            inline = len(request.inputs) <= INLINE_BYTES
            await protocol.write(writer, Submit(request.job_id, request.program_hash, len(request.inputs),
                                                request.inputs if inline else None, request.timeout,
                                                request.max_price, private=request.private,
                                                shared=request.shared, holds=holds, session=request.session,
                                                lane=request.lane, deadline=request.deadline))
            sent = len(request.inputs) if inline else 0
            reply = await protocol.read(reader, Send, Result, Error)
            if program_crossed is not None and not (isinstance(reply, Send) and reply.program):
                program_crossed.set_result(None)  # it holds the program (or refused the job): nothing to carry
            transfer_seconds = 0.0
            # At most: the program from peers (or us) with the inputs, then what of it the peers did not deliver, then
            # all of it if those pieces did not make the program (never more than one copy in all: ``budget``); then
            # the weights it names by reference that the worker holds nowhere (in rounds of MAX_TENSORS_ASKED: holders,
            # perhaps workers sent them since, the bytes), and once more if a checkpoint file of the worker's turned
            # out damaged.
            named: list[str] = []  # holders told of that only records vouch for
            # Weights asked for on this stream, each with when it was first (_weights_sends then): named holders
            # first, then maybe workers this client began sending them to since, then the bytes.
            asked: dict[str, int] = {}
            budget = [len(request.program)]  # program bytes this stream may still carry
            for _ in range(3 + 4 * _tensor_rounds(request)):
                if not isinstance(reply, Send):
                    break
                t0 = time.perf_counter()
                sent += await self._send_what_is_asked(worker_id, maddrs, request, reply, writer, program_crossed,
                                                       named, asked, budget)
                transfer_seconds += time.perf_counter() - t0
                reply = await protocol.read(reader, Send, Result, Error)
            if isinstance(reply, Send):
                raise ProtocolError(f"worker {worker_id[-8:]} keeps asking for the program")
            if isinstance(reply, Error):
                raise reply.exception()
            ran = True
            input_hash = reply.input_hash
            outputs = reply.outputs
            if outputs is None:
                t0 = time.perf_counter()
                outputs = bytes(await protocol.read_payload(
                    reader, reply.outputs_size, min(request.max_output_bytes, MAX_OUTPUT_BYTES), "outputs"))
                transfer_seconds += time.perf_counter() - t0
            receipt = _receipt(reply.receipt, request)
            if receipt is None:  # a session step its tab bills later: nothing to settle on this stream
                writer.close()
        except BaseException:
            writer.close()
            raise
        finally:
            if ran and not request.private:
                ran_it = self._ran.get(request.program_hash) or {}
                ran_it[worker_id] = tuple(maddrs)[:protocol.MAX_HOLDER_MADDRS]
                self._ran.put(request.program_hash, dict(list(ran_it.items())[-protocol.MAX_HOLDERS:]))
            receiving = self._receiving.get(request.program_hash)
            if receiving is not None:
                receiving.pop(worker_id, None)
                if not receiving:
                    del self._receiving[request.program_hash]

        async def finish(verdict: Verdict) -> None:
            # Written is not delivered: the bytes can leave this process and still be lost with the stream (the
            # daemon resets one now and then under a burst of streams, or this client's daemon stops a moment
            # later). The worker says when it has filed the verdict; without that word it goes by the settle door
            # (Settlement._on_stream), and a worker that did file it takes it again as filed already.
            try:
                await protocol.write(writer, verdict)
                reply = await protocol.read(reader, Ok, Error, timeout=VERDICT_ACK_TIMEOUT)
            finally:
                writer.close()
            if isinstance(reply, Error):  # it heard the verdict and took it as wrong: sending it again changes nothing
                logger.warning("Worker %s did not take this client's verdict on job %s: %s", worker_id[-8:],
                               request.job_id[:12], reply.message)

        return Delivery(worker_id, outputs, receipt, sent, transfer_seconds, finish=finish, close=writer.close,
                        input_hash=input_hash)

    async def _send_what_is_asked(self, worker_id: str, maddrs: Sequence[str], request: JobRequest, ask: Send,
                                  writer, program_crossed: asyncio.Future | None, named: list[str] | None = None,
                                  asked_tensors: dict[str, int] | None = None, budget: list[int] | None = None
                                  ) -> int:
        """Answer a worker's Send; returns the bytes sent. A worker that lacks the program and can fetch it from
        peers hears who holds it, if anyone does: the program crosses this client's link once, not once per
        worker. ``named``: this stream's holders that only records vouch for (added to here; if the worker asks for
        the program after all, they are not named again for a while)."""
        if ask.tensors:
            return await self._send_tensors(worker_id, request, ask, writer, asked_tensors)
        holders = self._holders(worker_id, request) if ask.program and ask.pieces else ()
        sent = 0
        if holders:
            # It serves what it fetches to the next ones meanwhile: listed as getting it (before anything is awaited,
            # so that workers asking at the same moment are pointed at each other too) until its job ends.
            self._receiving.setdefault(request.program_hash, {})[worker_id] = tuple(maddrs)[
                :protocol.MAX_HOLDER_MADDRS]
            pieces = await asyncio.shield(self._piece_list(request))  # a job cancelled here leaves it to others
            # Worth waiting for while they say "busy" (serving others, still receiving it): those this client is
            # sending it to now, and those that ran it for this client. Others are only what records claim.
            vouched = set(self._receiving.get(request.program_hash, ())) | set(self._ran.get(request.program_hash) or ())
            coming = frozenset(vouched & {peer for peer, _ in holders})
            if named is not None:
                named.extend(peer for peer, _ in holders if peer not in vouched)
            # The holders serve a program that is not shared only to a worker that presents this client's grant (made
            # from the bytes, naming that holder and this worker); the worker runs what it fetched for this client
            # only on its proof that it holds the bytes.
            # Those still getting it (from this client, or from peers as this one will) serve what they have so far
            # against grants made with this client's upload token for it (gpunet.protocol.holding); the others,
            # holding it whole, against the holding key.
            key = await self._holding_key(request) if self.peer_id is not None else None
            token = self._upload_token(request.program_hash)
            receiving = self._receiving.get(request.program_hash, {})
            grants = () if key is None else tuple(
                (peer, proof(token if peer in receiving else key, PIECE, peer, worker_id)) for peer, _ in holders)
            holds = None if key is None else proof(key, RUN, worker_id, self.peer_id)
            await protocol.write(writer, Pieces(pieces.size, pieces.piece_size, pieces.hashes, holders, coming,
                                                grants, holds, token if key is not None else None))
            await protocol.write(writer, Payload(None, len(request.inputs) if ask.inputs else None))
        else:
            if ask.program and named:  # the peers it was told of did not deliver
                until = time.monotonic() + UNHELPFUL_SECONDS
                struck = self._unhelpful.get(request.program_hash) or {}
                self._unhelpful.put(request.program_hash, {**struck, **{peer: until for peer in named}})
                named.clear()
            if ask.program and not request.private:
                # Listed (before anything is awaited, so that replicas asking at the same moment see it) until its
                # job ends (run_stream): by then it serves the program from its disk.
                self._receiving.setdefault(request.program_hash, {})[worker_id] = tuple(maddrs)[
                    :protocol.MAX_HOLDER_MADDRS]
                self._piece_list(request)  # hashed meanwhile: the next worker to lack it will ask for the list
            token = self._upload_token(request.program_hash) if ask.program and not request.private else None
            # Only the pieces the peers did not deliver, when that is what it asks for.
            program = _pieces_of(request.program, ask.missing, worker_id) if ask.missing else [request.program]
            size = sum(len(part) for part in program)
            if ask.program and budget is not None:
                if size > budget[0]:
                    raise ProtocolError(f"worker {worker_id[-8:]} asked for more of the program than one copy")
                budget[0] -= size
            await protocol.write(writer, Payload(size if ask.program else None,
                                                 len(request.inputs) if ask.inputs else None, token=token))
            if ask.program:
                for part in program:
                    await protocol.write_payload(writer, part)
                sent += size
                self.program_bytes_sent += size
        if program_crossed is not None and not program_crossed.done():
            program_crossed.set_result(None)
        if ask.inputs:
            await protocol.write_payload(writer, request.inputs)
            sent += len(request.inputs)
        return sent

    async def _send_tensors(self, worker_id: str, request: JobRequest, ask: Send, writer,
                            asked: dict[str, int] | None = None) -> int:
        """The weights the job names by reference that the worker holds nowhere, in the order asked (only the job's
        own: a worker cannot ask this client for anything else). Asked for the first time on this stream while
        workers keep their checkpoint, the answer names those instead (TensorHolders); asked again (``Send.again``),
        the workers this client began sending any of them to since, once; else the bytes go. ``asked``: what this
        stream asked for before, and when (added to here)."""
        found = [_weight(request, sha) for sha in ask.tensors]
        if any(f is None for f in found) or ask.program or ask.inputs or len(set(ask.tensors)) < len(ask.tensors):
            raise ProtocolError(f"worker {worker_id[-8:]} asked for weights this job does not name (or one twice)")
        # Other workers that have them: those that keep their checkpoint, and those this client sent them to or
        # pointed at holders of them (served on against grants made with this client's upload token). This one is
        # listed too, before anything is awaited: workers asking at the same moment are pointed at each other.
        token = self._upload_token(request.program_hash)
        had = {} if request.private else dict(self._weights_at.get(request.program_hash) or {})
        if not request.private:
            self._weights_at.put(request.program_hash, {**had, worker_id: True})
        others = [w for w in had if w != worker_id]
        holders = tuple(dict.fromkeys([*(h for h in request.weight_holders if h != worker_id), *others]))[
            :protocol.MAX_HOLDERS]
        first = asked is not None and not any(sha in asked for sha in ask.tensors)
        if asked is not None and first and holders:
            asked.update(dict.fromkeys(ask.tensors, self._weights_sends))
        elif asked is not None and ask.again and not request.private:
            # Asked again: workers this client began sending any of them to after this stream's first ask (two
            # workers that missed the same weight at once: the second waits for the first's copy, which it
            # serves once it lands). Once: asked once more, the bytes come.
            holders = tuple(w for w, began in (self._weights_to.get(request.program_hash) or {}).items()
                            if w != worker_id and any(began.get(sha, -1) > asked.get(sha, self._weights_sends)
                                                      for sha in ask.tensors))[:protocol.MAX_HOLDERS]
            asked.update(dict.fromkeys(ask.tensors, _ASKED_AGAIN))  # asked once more, the bytes come
        else:
            holders = ()
        if holders:
            # A grant for every holder, not only those this client sent the weights to yet: one named for keeping
            # the checkpoint may have been sent a tensor its own file got wrong by the time this worker asks it.
            grants = tuple((peer, proof(token, PIECE, peer, worker_id)) for peer in holders)
            await protocol.write(writer, TensorHolders(holders, grants, token))
            return 0
        not_held = next((f for f in found if isinstance(f, WeightsNotHeld)), None)
        if not_held is not None:  # no holder named, or none delivered: this worker cannot run it
            raise not_held
        total = sum(memoryview(f).nbytes for f in found)
        began, send = self._sending_weights(request, worker_id, ask.tensors)
        try:
            await protocol.write(writer, Payload(None, None, total, token=token))
            for data in found:
                await protocol.write_payload(writer, data)
        except BaseException:  # it will not hold these: nobody is pointed at it for them
            for sha in ask.tensors:
                if began.get(sha) == send:
                    del began[sha]
            raise
        self.program_bytes_sent += total
        self.weight_bytes_sent += total
        return total

    def _sending_weights(self, request: JobRequest, worker_id: str, tensors) -> tuple[dict[str, int], int]:
        """Note that these weights' bytes go to ``worker_id`` now (before anything is awaited: a worker asking again
        at the same moment is pointed at it); returns that worker's map of weights to sends, and this send's."""
        self._weights_sends += 1
        sending = {} if request.private else self._weights_to.get(request.program_hash)
        if sending is None:
            sending = {}
            self._weights_to.put(request.program_hash, sending)
        began = sending.setdefault(worker_id, {})
        began.update(dict.fromkeys(tensors, self._weights_sends))
        return began, self._weights_sends

    async def holds(self, worker_id: str, request: JobRequest) -> bytes | None:
        """This client's proof, for ``worker_id``, that it holds the program's bytes (None for a private program,
        which no worker keeps a copy of to check it against)."""
        if request.private or self.peer_id is None:
            return None
        return proof(await self._holding_key(request), RUN, worker_id, self.peer_id)

    def _holds_known(self, worker_id: str, request: JobRequest) -> bytes | None:
        """:meth:`holds` if the program's key is computed already or cheap to (None otherwise: a big program is not
        hashed for a worker that is not known to hold it)."""
        if request.private or self.peer_id is None:
            return None
        if len(request.program) < KEY_IN_THREAD_BYTES:
            self._holding_key(request)  # computed at once
        found = self._keys.get(request.program_hash)
        if found is None or not found.done() or found.cancelled() or found.exception() is not None:
            return None
        return proof(found.result(), RUN, worker_id, self.peer_id)

    def _holding_key(self, request: JobRequest) -> asyncio.Future:
        """The program's holding key, computed once (a pass over the program; in a thread when it is big)."""
        found = self._keys.get(request.program_hash)
        if found is None:
            if len(request.program) >= KEY_IN_THREAD_BYTES:
                found = asyncio.ensure_future(asyncio.to_thread(holding_key, request.program))
                found.add_done_callback(lambda f: f.cancelled() or f.exception())
            else:
                found = asyncio.get_running_loop().create_future()
                found.set_result(holding_key(request.program))
            self._keys.put(request.program_hash, found)
        return asyncio.shield(found)

    def _piece_list(self, request: JobRequest) -> asyncio.Future:
        """The program's piece list, hashed once in a thread (a second of work per GB)."""
        found = self._piece_lists.get(request.program_hash)
        if found is None:
            found = asyncio.ensure_future(asyncio.to_thread(PieceList.of, request.program))
            found.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, even if nobody awaits it
            self._piece_lists.put(request.program_hash, found)
        return found

    def _upload_token(self, program_hash: str) -> bytes:
        """This client's upload token for a program (gpunet.protocol.holding): random, one per program."""
        token = self._tokens.get(program_hash)
        if token is None:
            token = secrets.token_bytes(protocol.PROOF_BYTES)
            self._tokens.put(program_hash, token)
        return token

    def _holders(self, worker_id: str, request: JobRequest) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Who a worker may fetch this program from: those routing knows hold it, those that ran it for this client,
        then those this client is sending it to right now (they serve it once it is loaded). Never for a private
        program."""
        if request.private:
            return ()
        # Those this client vouches for first: records alone could fill every place with holders that never deliver.
        found = dict(self._ran.get(request.program_hash) or {})
        for peer, maddrs in self._receiving.get(request.program_hash, {}).items():
            found.setdefault(peer, maddrs)
        struck, now = self._unhelpful.get(request.program_hash) or {}, time.monotonic()
        for peer, maddrs in request.holders:
            if struck.get(peer, 0.0) <= now:
                found.setdefault(peer, maddrs)
        found.pop(worker_id, None)
        return tuple(found.items())[:protocol.MAX_HOLDERS]

    def forget(self, worker_id: str) -> None:
        """A worker that failed or left is named to no other as a holder (until it runs the program for us again):
        a worker told to fetch a program from a dead peer spends seconds on its dials before it asks us (a span
        moving after its worker died waited 8 s)."""
        for program in list(self._receiving):
            receiving = self._receiving[program]
            receiving.pop(worker_id, None)
            if not receiving:
                del self._receiving[program]
        for ran in self._ran.values():
            ran.pop(worker_id, None)
        for at in self._weights_at.values():
            at.pop(worker_id, None)
        for to in self._weights_to.values():
            to.pop(worker_id, None)

    async def settle(self, worker_id: str, items: Sequence[tuple[str, bytes]]) -> None:
        await self.rpc.call(worker_id, Door.SETTLE, SettleBatch(tuple(items)), Ok, Error)

    async def cancel(self, worker_id: str, job_id: str) -> bool:
        """Ask a worker to stop a job we submitted through the unary door; True if it was still queued or running."""
        reply = await self.rpc.call(worker_id, Door.CANCEL, Cancel(job_id), Ok, Error)
        if isinstance(reply, Error):
            raise reply.exception()
        return bool(reply.cancelled)

    async def close_session(self, worker_id: str, session_id: str, received: int | None = None) -> Delivery | None:
        """End one of our sessions on a worker (its state is freed there): the receipt of its steps not billed yet,
        up to the ``received`` steps we got answers to (None when there are none, or it was not open)."""
        reply = await self.rpc.call(worker_id, Door.CANCEL, CloseSession(session_id, received), SessionClosed, Error)
        if isinstance(reply, Error):
            raise reply.exception()
        if reply.receipt is None:
            return None

        async def finish(verdict: Verdict) -> None:
            await self.rpc.call(worker_id, Door.SETTLE, verdict, Ok, Error)

        return Delivery(worker_id, b"", Receipt.from_bytes(reply.receipt), 0, 0.0, via_unary=True, finish=finish)

    # --- speed challenges (gpunet.speedproof; the client's policy is in gpunet.client.proofs) ----------------------

    async def prove(self, worker_id: str, challenge: ProveSpeed) -> tuple[SpeedCommitment, float]:
        """Send a speed challenge: the worker's commitment, and the seconds it took on this client's clock, less the
        network's share. That share is one ping's round trip (measured just before, over the same connection) but
        never more than a tenth of the time: the worker controls how fast it answers pings, and a slow pong must not
        make its proof look fast."""
        t0 = time.perf_counter()
        await self.rpc.ping(worker_id)
        round_trip = time.perf_counter() - t0
        t0 = time.perf_counter()
        reply = await self.rpc.call(worker_id, Door.PROVE, challenge, SpeedCommitment, Error)
        elapsed = time.perf_counter() - t0
        if isinstance(reply, Error):
            raise reply.exception()
        return reply, elapsed - min(round_trip, 0.1 * elapsed)

    async def open_proof(self, worker_id: str, request: OpenProof) -> ProofOpening:
        reply = await self.rpc.call(worker_id, Door.PROVE, request, ProofOpening, Error)
        if isinstance(reply, Error):
            raise reply.exception()
        return reply


class _UseStream(GpunetError):
    """The worker cannot take this job through the unary door (it lacks the program, or the outputs are large)."""


def _weight(request: JobRequest, sha: str):
    """A weight's bytes for a worker that asks: None when the job does not name it, WeightsNotHeld (returned, not
    raised: holders may deliver it) when this client holds only its hash."""
    if request.weights is None:
        return None
    try:
        return request.weights(sha)
    except WeightsNotHeld as e:
        return e
