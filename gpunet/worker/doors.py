"""The worker's doors (:class:`gpunet.protocol.Door`): each handler decodes a request, calls the room that owns the
work (:mod:`~gpunet.worker.jobs`, :mod:`~gpunet.worker.proofs`, :mod:`~gpunet.worker.handoff`, the billing) and
encodes the reply; errors become :class:`~gpunet.protocol.Error` messages, never a dropped worker. The messages
themselves, and the exchange on each door, are defined once in :mod:`gpunet.protocol`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from functools import partial

from gpunet import protocol
from gpunet.errors import GpunetError, JobFailed, JobRejected, ProgramNotCached, ProtocolError
from gpunet.ledger.receipts import Receipt
from gpunet.protocol import (
    FRAME_TIMEOUT,
    INLINE_BYTES,
    MAX_PING_BYTES,
    RUN,
    STEPS_IDLE,
    UNARY_OUTPUT_BYTES,
    Cancel,
    CloseSession,
    Countersign,
    Door,
    Error,
    GetInfo,
    Message,
    Info,
    Ok,
    OpenProof,
    Ping,
    Pong,
    ProveSpeed,
    Push,
    PushGroup,
    Refuse,
    Result,
    SessionClosed,
    SettleBatch,
    StepGroup,
    StepGroupAnswer,
    Submit,
    UseStream,
    verifies,
)
from gpunet.rpc import RPC
from gpunet.worker import metrics
from gpunet.worker.batching import Together
from gpunet.worker.jobs import Answer, Jobs
from gpunet.worker.payloads import NeedsStream, StreamPayloads, UnaryPayloads

logger = logging.getLogger("gpunet.worker")

COUNTERSIGN_TIMEOUT = 30.0
#: After an error, how long (and how many bytes) a worker reads what the client still sends before it closes the
#: stream (see _try_send).
LINGER = 2.0
LINGER_BYTES = 1 << 20
#: ``steps`` and ``pushes`` streams held open at once, in all, per peer and per network address (identities are
#: free): each holds a socket of the daemon's and a task here. A stream over these serves one exchange, whose frame
#: must come within FRAME_TIMEOUT, and closes (its peer opens one each time then).
MAX_KEPT_STREAMS = 256
MAX_KEPT_STREAMS_PER_PEER = 8
MAX_KEPT_STREAMS_PER_HOST = 32
#: A step group's answer is one frame: its replies fit in it, with this much left for the frame's own bytes and a
#: UseStream for each reply that did not fit.
GROUP_FRAME_SLACK = 2048
#: How long a group's answer waits for its steps still running once one of them is done (at least as long as that
#: one took): those not done by then are answered UseStream, and asked for alone.
GROUP_STRAGGLER_WAIT = 0.5


class Doors:
    """Serves the job, run, settle, cancel, push, ping, info and prove doors of one worker."""

    def __init__(self, jobs: Jobs):
        self.jobs, self.record = jobs, jobs.prover.record  # the worker's record now (the info door sends it)
        self.admission, self.billing = jobs.admission, jobs.billing
        # id(answer) -> [streams writing it now, the client and address its bytes are held against] (held once)
        self._writing: dict[int, list] = {}
        self._rpc: RPC | None = None
        # steps and pushes streams open now, per peer and per address
        self._kept_by_peer: Counter[str] = Counter()
        self._kept_by_host: Counter[str] = Counter()

    async def start(self, rpc: RPC) -> None:
        self._rpc = rpc
        await self.jobs.start(rpc)  # first: a step served by a door pushes its output on through it
        await rpc.serve_stream(Door.JOB, self.job)
        await rpc.serve_stream(Door.INFO, self.info)
        await rpc.serve_unary(Door.PING, self.ping)
        await rpc.serve_unary(Door.RUN, self.run)
        await rpc.serve_unary(Door.SETTLE, self.settle)
        await rpc.serve_unary(Door.CANCEL, self.cancel)
        await rpc.serve_unary(Door.PROVE, self.prove)
        await rpc.serve_unary(Door.PUSH, self.push)
        await rpc.serve_stream(Door.STEPS, self.steps)
        await rpc.serve_stream(Door.PUSHES, self.pushes)

    async def stop(self) -> None:
        await self.jobs.stop()
        if self._rpc is not None:
            await self._rpc.close()
        await self.billing.close()

    # --- ping, info, prove ------------------------------------------------------------------------------------------

    async def ping(self, request: bytes, client_id: str) -> bytes:
        try:
            echo = protocol.decode(request, Ping).echo[:MAX_PING_BYTES]
        except GpunetError as e:
            return protocol.encode(Error.of(e))
        return protocol.encode(Pong(time.time(), echo))

    async def info(self, client_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   host: str = "") -> None:
        try:
            await protocol.read(reader, GetInfo, timeout=FRAME_TIMEOUT)
            await protocol.write(writer, Info(time.time(), self.record().to_wire()))
        except GpunetError as e:
            logger.debug("info request from %s failed: %s", client_id[-8:], e)
        finally:
            writer.close()

    async def prove(self, request: bytes, client_id: str) -> bytes:
        """A speed challenge, or the opening of the products the client picked from its last one."""
        try:
            message = protocol.decode(request, ProveSpeed, OpenProof)
            prover = self.jobs.prover
            reply = await (prover.prove(client_id, message) if isinstance(message, ProveSpeed)
                           else prover.open(client_id, message))
            return protocol.encode(reply)
        except GpunetError as e:
            return protocol.encode(Error.of(e))
        except Exception as e:  # a device error (out of memory): the challenge fails, the worker goes on
            logger.warning("Speed challenge from %s failed here: %s", client_id[-8:], e)
            return protocol.encode(Error.of(JobFailed(f"speed challenge failed on this worker: {type(e).__name__}")))

    # --- jobs: the stream door (any size) --------------------------------------------------------------------------

    async def job(self, client_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  host: str = "") -> None:
        self.admission.stream_opened()
        self.admission.came_from(client_id, host)
        try:
            submit = await protocol.read(reader, Submit, timeout=FRAME_TIMEOUT)
            payloads = StreamPayloads(reader, writer, self.jobs.limits, self.jobs.spool_dir, self.jobs.fetcher,
                                      proves=partial(verifies, purpose=RUN, verifier=self.jobs.identity.peer_id,
                                                     prover=client_id))
            answer = await self.jobs.execute(client_id, submit, payloads, reader, host)
            await self._reply(answer, writer, client_id, host)
            if answer.receipt is not None:  # a session step billed later has nothing to settle now
                await self._settle_from_stream(client_id, answer.receipt, reader, writer)
        except ProtocolError as e:
            metrics.JOBS.labels("protocol_error").inc()
            logger.info("Stream from %s dropped (malformed, stalled or broken): %s", client_id[-8:], e)
            await _try_send(writer, Error.of(e), reader)
        except GpunetError as e:  # refused, failed or timed out: the client gets the reason
            await _try_send(writer, Error.of(e, queue=self.admission.queue_length), reader)
        except Exception as e:  # never let one stream take the worker down
            logger.exception("Unexpected error while serving %s", client_id[-8:])
            await _try_send(writer, Error.of(JobFailed(f"worker error: {type(e).__name__}")), reader)
        finally:
            writer.close()
            self.admission.stream_closed()

    async def _settle_from_stream(self, client_id: str, receipt: Receipt, reader, writer) -> None:
        """Wait briefly for the countersignature on the stream, and say once it is filed (a verdict the client wrote
        can still be lost with the stream: without this word it sends it again by the settle door). Without it the
        receipt stays in the unpaid list, awaited with the unary door's."""
        try:
            message = await protocol.read(reader, Countersign, Refuse, timeout=COUNTERSIGN_TIMEOUT)
        except ProtocolError:
            logger.info("Client %s did not countersign job %s on its stream: awaited at the settle door",
                        client_id[-8:], receipt.job_id[:12])
            # Its countersignature may still come with a later job or batch: awaited with the unary door's, not
            # looked up among the kept results (they are for retries, and others' results push them out).
            self.billing.awaiting.expect(client_id, receipt)
            return
        try:
            if message.job_id != receipt.job_id:
                raise ProtocolError("the settlement names another job than the one delivered on this stream")
            self.billing.awaiting.settle(client_id, message, receipt)
            self.billing.books.flush()  # off the job's path already (the answer has gone): make the payment durable
        except GpunetError as e:
            logger.warning("Bad settlement from %s for job %s: %s", client_id[-8:], receipt.job_id[:12], e)
            await _try_send(writer, Error.of(e))
            return
        await _try_send(writer, Ok())

    async def _reply(self, answer: Answer, writer, client_id: str, host: str) -> None:
        """The answer, within the time its size allows: a client that stops reading does not pin it here for long,
        and while it is written its bytes count against its client's share of the payload buffer (Admission.hold):
        one that does not read its answers has its next payloads refused, not this process's memory filled."""
        size = len(answer.outputs)
        inline = size <= INLINE_BYTES
        held = self._writing.get(id(answer))  # a retry's stream writes the same bytes: held once
        if held is None:
            self.admission.hold(size, client_id, host)
            held = self._writing[id(answer)] = [0, client_id, host]
        held[0] += 1
        try:
            async with asyncio.timeout(protocol.payload_deadline(size)):
                await protocol.write(writer, Result(size, _receipt_bytes(answer),
                                                    answer.outputs if inline else None, answer.input_hash))
                if not inline:
                    await protocol.write_payload(writer, answer.outputs)
        except (TimeoutError, ProtocolError) as e:
            if answer.receipt is not None:  # it may have got the receipt, and countersign it later
                self.billing.awaiting.expect(client_id, answer.receipt)
            if isinstance(e, TimeoutError):
                raise ProtocolError("the client stopped reading the result") from None
            raise
        finally:
            held[0] -= 1
            if not held[0]:
                del self._writing[id(answer)]
                self.admission.release_bytes(size, held[1], held[2])
        metrics.BYTES_OUT.inc(size)

    # --- jobs: the unary door (small jobs whose program the worker holds: one round trip) ----------------------------

    async def run(self, request: bytes, client_id: str) -> bytes:
        try:
            submit = protocol.decode(request, Submit)
            if submit.settle_malformed:
                logger.warning("Ignored %d malformed countersignature(s) from %s (the job itself is served)",
                               submit.settle_malformed, client_id[-8:])
            self.billing.awaiting.ride_along(client_id, submit.settle)  # checked and filed after the reply
            host = self.admission.unary_host(client_id)
            if host is None:
                raise NeedsStream()  # the unary door does not see the peer's address: the stream door does
            answer = await self.jobs.execute(client_id, submit, UnaryPayloads(), None, host)
            if len(answer.outputs) > UNARY_OUTPUT_BYTES:
                return protocol.encode(UseStream())  # the answer waits in the recent results for the stream retry
            if answer.receipt is not None:
                self.billing.awaiting.expect(client_id, answer.receipt)  # countersigned by a later call
            return protocol.encode(Result(len(answer.outputs), _receipt_bytes(answer), answer.outputs,
                                          answer.input_hash))
        except (NeedsStream, ProgramNotCached):  # the stream door can resend the program
            return protocol.encode(UseStream())
        except GpunetError as e:
            return protocol.encode(Error.of(e, queue=self.admission.queue_length))
        except Exception as e:
            logger.exception("Unexpected error while serving %s", client_id[-8:])
            return protocol.encode(Error.of(JobFailed(f"worker error: {type(e).__name__}")))

    async def settle(self, request: bytes, client_id: str) -> bytes:
        try:
            message = protocol.decode(request, Countersign, Refuse, SettleBatch)
            if isinstance(message, SettleBatch):
                if message.malformed:
                    logger.warning("Ignored %d malformed countersignature(s) from %s", message.malformed, client_id[-8:])
                await self.billing.awaiting.batch(client_id, message.items)
            else:
                self.billing.awaiting.settle(client_id, message)
                self.billing.books.flush()
            return protocol.encode(Ok())
        except GpunetError as e:
            return protocol.encode(Error.of(e))

    async def cancel(self, request: bytes, client_id: str) -> bytes:
        """A client stops one of its own jobs, or ends one of its sessions (its state is freed, its tab billed)."""
        try:
            message = protocol.decode(request, Cancel, CloseSession)
            if isinstance(message, CloseSession):
                closed, receipt = await self.jobs.sessions.close(client_id, message.session_id, message.received)
                return protocol.encode(SessionClosed(closed, receipt.to_bytes() if receipt else None))
            return protocol.encode(Ok(cancelled=self.jobs.cancel(client_id, message.job_id)))
        except GpunetError as e:
            return protocol.encode(Error.of(e))

    # --- session steps: a stream kept open for them (the run door's exchange, without a stream set up per step) ----

    async def steps(self, client_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    host: str = "") -> None:
        """A client's session steps, one after another on one stream: each Submit (inputs inline) is answered as the
        run door answers it, its outputs after its Result when they do not fit in the frame. The stream ends when
        its client closes it, sends nothing for STEPS_IDLE seconds, or breaks the exchange; and after one step when
        this client (or everyone) holds as many open as the worker takes. Only while a step is in flight does the
        stream count as one the worker must see through before it leaves."""
        self.admission.came_from(client_id, host)

        async def step(message: Submit | StepGroup) -> bool:
            self.admission.stream_opened()
            try:  # (a worker leaving answers as the run door does: WorkerDraining, then the stream ends)
                if isinstance(message, StepGroup):
                    ok = await self._step_group(client_id, host, message, writer)
                else:
                    ok = await self._step(client_id, host, message, writer)
                return ok and self.admission.accepting
            finally:
                self.admission.stream_closed()

        await self._kept_stream(client_id, host, reader, writer, (Submit, StepGroup), step)

    async def _kept_stream(self, peer_id: str, host: str, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter, kinds: tuple[type, ...], answer) -> None:
        """A stream kept open by its peer: each frame of one of ``kinds`` read (begun within STEPS_IDLE seconds, whole
        within FRAME_TIMEOUT) is answered by ``answer`` (False: the stream ends) until the peer closes it, goes quiet
        or breaks the exchange; after one exchange when this peer, its address or everyone holds as many open as the
        worker takes."""
        self._kept_by_peer[peer_id] += 1
        self._kept_by_host[host] += 1
        over = (self._kept_by_peer[peer_id] > MAX_KEPT_STREAMS_PER_PEER
                or self._kept_by_host[host] > MAX_KEPT_STREAMS_PER_HOST
                or self._kept_by_peer.total() > MAX_KEPT_STREAMS)
        try:
            while True:
                try:
                    message = await protocol.read(reader, *kinds, timeout=FRAME_TIMEOUT,
                                                  idle=None if over else STEPS_IDLE)
                except ProtocolError:  # closed, quiet or malformed: nothing is in flight on it
                    return
                if not await answer(message) or over:
                    return
        finally:
            writer.close()
            for counts, key in ((self._kept_by_peer, peer_id), (self._kept_by_host, host)):
                counts[key] -= 1
                if not counts[key]:
                    del counts[key]

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, message: Message) -> bool:
        """A short answer on a kept stream, within FRAME_TIMEOUT (a peer that stops reading must not pin the stream
        and its task here); False when it could not be written (the stream is aborted then)."""
        try:
            async with asyncio.timeout(FRAME_TIMEOUT):
                await protocol.write(writer, message)
            return True
        except (TimeoutError, ProtocolError):
            writer.transport.abort()
            return False

    async def _run_step(self, client_id: str, host: str, submit: Submit, together: Together | None = None
                        ) -> Answer | Message:
        """One step of a steps stream run: its answer, or the message that says why there is none."""
        if submit.settle_malformed:
            logger.warning("Ignored %d malformed countersignature(s) from %s (the step itself is served)",
                           submit.settle_malformed, client_id[-8:])
        self.billing.awaiting.ride_along(client_id, submit.settle)
        try:
            if submit.session is None:
                raise JobRejected("the steps door takes session steps; other jobs go through the run or job door")
            # No reader: the next frame on this stream is the next step, not a hang-up (a step runs to its end).
            return await self.jobs.execute(client_id, submit, UnaryPayloads(), None, host, together)
        except (NeedsStream, ProgramNotCached):  # the job door can carry what the step lacks
            return UseStream()
        except GpunetError as e:
            return Error.of(e, queue=self.admission.queue_length)
        except Exception as e:
            logger.exception("Unexpected error while serving %s", client_id[-8:])
            return Error.of(JobFailed(f"worker error: {type(e).__name__}"))

    async def _step_group(self, client_id: str, host: str, group: StepGroup, writer: asyncio.StreamWriter) -> bool:
        """Answer a group of steps (each run as :meth:`_step` runs one, those of one span let into the lanes
        together) with one frame; False when it could not be written. A step not done GROUP_STRAGGLER_WAIT (or as
        long as the first took) after the first one is (its pushed input came late), and a reply that does not fit
        in the frame after the others, are answered UseStream: the client asks for each alone by its job id and gets
        its answer (from the recent results, or by joining its run), so one late step does not hold the others'."""
        loop = asyncio.get_running_loop()
        together = Together(group.submits, self.jobs.turns.enqueue_all)
        began = loop.time()
        runs = [asyncio.ensure_future(self._run_step(client_id, host, s, together)) for s in group.submits]
        try:
            await asyncio.wait(runs, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait(runs, timeout=max(GROUP_STRAGGLER_WAIT, loop.time() - began))
        except BaseException:
            for run in runs:  # (a session step itself runs on to its end: Jobs.execute)
                run.cancel()
            raise
        replies, expected, room = [], [], protocol.MAX_FRAME_BYTES - GROUP_FRAME_SLACK
        for run in runs:
            reply = run.result() if run.done() else UseStream()  # (the rest go on: asked for alone)
            if not isinstance(reply, Message):
                if reply.receipt is not None:  # (one answered UseStream gets it when asked again)
                    expected.append(reply.receipt)
                reply = Result(len(reply.outputs), _receipt_bytes(reply), reply.outputs, reply.input_hash)
            size = len(protocol.encode(reply))
            if size > room:
                reply, size = UseStream(), 0  # (the slack holds every UseStream)
            room -= size
            replies.append(reply)
        # While it is written its bytes count against the client's share, as a single answer's do (see _reply).
        held = protocol.MAX_FRAME_BYTES - GROUP_FRAME_SLACK - room
        self.admission.hold(held, client_id, host)
        try:
            written = await self._answer(writer, StepGroupAnswer(tuple(replies)))
        finally:
            self.admission.release_bytes(held, client_id, host)
        if written:
            metrics.BYTES_OUT.inc(sum(r.outputs_size for r in replies if isinstance(r, Result)))
        for receipt in expected:  # countersigned by a later call, as for the run door (sent or not: see _reply)
            self.billing.awaiting.expect(client_id, receipt)
        return written

    async def _step(self, client_id: str, host: str, submit: Submit, writer: asyncio.StreamWriter) -> bool:
        """Answer one step on a steps stream; False when the stream broke on the way (it is closed then)."""
        answer = await self._run_step(client_id, host, submit)
        if isinstance(answer, Message):
            reply: Message = answer
        else:
            try:
                await self._reply(answer, writer, client_id, host)
            except ProtocolError as e:  # broke, or the client stopped reading: nothing more goes on it
                logger.info("Steps stream from %s broke: %s", client_id[-8:], e)
                writer.transport.abort()
                return False
            if answer.receipt is not None:  # countersigned by a later call, as for the run door
                self.billing.awaiting.expect(client_id, answer.receipt)
            return True
        return await self._answer(writer, reply)

    # --- pushed steps: span to span without the client in between (docs/sessions.md) --------------------------------

    async def push(self, request: bytes, sender_id: str) -> bytes:
        """Another worker's output for the next step of a session held here."""
        try:
            return protocol.encode(self._offer(sender_id, protocol.decode(request, Push)))
        except GpunetError as e:
            return protocol.encode(Error.of(e))

    async def pushes(self, sender_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     host: str = "") -> None:
        """Pushes from one worker over a stream it keeps open, each answered as the push door answers it."""
        async def answer(message: Push | PushGroup) -> bool:
            if isinstance(message, PushGroup):
                replies = [self._offer(sender_id, push) for push in message.pushes]
                return await self._answer(writer, next((r for r in replies if isinstance(r, Error)), Ok()))
            return await self._answer(writer, self._offer(sender_id, message))

        await self._kept_stream(sender_id, host, reader, writer, (Push, PushGroup), answer)

    def _offer(self, sender_id: str, push: Push) -> Ok | Error:
        try:
            self.jobs.handoff.offer(sender_id, push)
            return Ok()
        except GpunetError as e:
            return Error.of(e)


def _receipt_bytes(answer: Answer) -> bytes:
    """An answer's receipt as sent; empty for a session step its session's tab bills later."""
    return answer.receipt.to_bytes() if answer.receipt is not None else b""


async def _try_send(writer, message: Error | Ok, reader=None) -> None:
    """Tell the peer why, if it is still reading; a peer that stopped reading gets the connection cut instead.

    ``reader``: what the peer sent that was not read (the rest of a refused upload, bytes after a bad frame) is read
    and dropped until it hangs up (for at most LINGER seconds and bytes): closing a libp2p stream with unread bytes in
    it resets the stream, and a reset throws away our answer before the peer has read it."""
    try:
        async with asyncio.timeout(2.0):
            await protocol.write(writer, message)
    except Exception:
        writer.transport.abort()
        return
    if reader is None:
        return
    try:
        async with asyncio.timeout(LINGER):
            dropped = 0
            while dropped < LINGER_BYTES and (chunk := await reader.read(64 * 1024)):
                dropped += len(chunk)
    except (TimeoutError, ConnectionError, OSError, RuntimeError):  # RuntimeError: a read of ours still pending
        pass
