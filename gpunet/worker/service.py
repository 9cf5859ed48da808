"""The worker's doors: handlers that move bytes between the network and the executor pool, nothing else.

What to take is decided by :mod:`gpunet.worker.admission` (a pure state machine); getting paid by
:mod:`gpunet.worker.settlement`; the messages themselves are defined once in :mod:`gpunet.protocol`, which also draws
the exchange on each door. This module runs admitted jobs and signs their receipts.

Job ids are per client: the same (client, job id) is never run twice; a repeat waits for, or gets, the first run's
result and the same receipt, so a retry is never billed twice. Every size is checked before it is read.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

from gpunet import protocol, speedproof
from gpunet.protocol import tensorframe
from gpunet.errors import (
    DeadlineUnreachable,
    ExecutorDied,
    GpunetError,
    JobFailed,
    JobPreempted,
    JobRejected,
    JobTimeout,
    ProgramNotCached,
    ProtocolError,
    SessionLost,
    WorkerBusy,
    WorkerDraining,
)
from gpunet.identity import Identity
from gpunet.ledger import tabs
from gpunet.ledger.receipts import Receipt, sign_as_worker
from gpunet.ledger.entries import Unbilled
from gpunet.ledger.store import Ledger
from gpunet.ledger.writer import LedgerWriter
from gpunet.protocol import (
    BACKGROUND,
    FRAME_TIMEOUT,
    INLINE_BYTES,
    INTERACTIVE,
    MAX_PING_BYTES,
    UNARY_OUTPUT_BYTES,
    Cancel,
    CloseSession,
    Countersign,
    SessionClosed,
    Door,
    Error,
    GetInfo,
    Info,
    Ok,
    OpenProof,
    Payload,
    Pieces,
    Ping,
    Pong,
    ProofOpening,
    ProveSpeed,
    Push,
    PushTo,
    Refuse,
    Result,
    Send,
    SettleBatch,
    SpeedCommitment,
    Submit,
    UseStream,
)
from gpunet.rpc import RPC
from gpunet.utils import LRU, Debounce, When, human_seconds, sha256_hex, wait_out
from gpunet.worker import metrics
from gpunet.worker.admission import Admission, ServiceLimits
from gpunet.worker.executor import STOP_GRACE, DryRun
from gpunet.worker.lanes import Action, Blame, Lanes, Start, Ticket
from gpunet.worker.peers import Fetcher, PieceServer
from gpunet.worker.pushes import Pushes
from gpunet.worker.sessions import Ended, SessionLimits, Sessions
from gpunet.worker.settlement import Settlement
from gpunet.worker.uploads import Upload, Uploads, content_hash

logger = logging.getLogger("gpunet.worker")

COUNTERSIGN_TIMEOUT = 30.0
RECENT_JOBS = 100
LANE_GAUGES_DELAY = 0.1  # seconds from a change in the lanes to their gauges (metrics.count_lanes)
#: After an error, how long (and how many bytes) a worker reads what the client still sends before it closes the
#: stream (see _try_send).
LINGER = 2.0
LINGER_BYTES = 1 << 20
#: An executor killed by a job counts as this many stopped jobs against its client (see Admission): a crash is no
#: accident an honest client makes often, and each one costs the worker a torch import.
CRASH_WEIGHT = 5
MAX_RECENT_RESULTS = 4096
MAX_PRIVATE_PROGRAMS = 4096  # private programs whose owners are tracked (see JobService._add_owner)
#: Speed proofs whose row digests are kept for their opening (8 n bytes per product: 16 KiB at n = 2048, so at most
#: 16 MiB per proof and 256 MiB in all; a CPU worker's proof is a few hundred KiB).
MAX_OPEN_PROOFS = 16
#: How long a worker tries to push a step's output to the next span's worker (that step then asks its client), and
#: how many pushes it has on their way at most.
PUSH_TIMEOUT = 10.0
MAX_PUSHING = 64
#: ...and at most this many per session a client may hold here (--max-sessions-per-client): its client names the peer
#: a push goes to, and a peer that never answers holds each for PUSH_TIMEOUT, so one client's pushes must not take
#: every other client's place (a session pushes one output per step, one step at a time: two leave room for a slow one).
MAX_PUSHING_PER_SESSION = 2

__all__ = ["JobService", "ServiceLimits"]


@dataclass
class Outcome:
    outputs: bytes
    receipt: Receipt | None  # None: a session step its session's tab bills later (gpunet.ledger.tabs)
    state_bytes: int = 0  # a session step: what the session's state holds on this worker
    flops: int = 0
    wall_time_us: int = 0
    started_at_us: int = 0
    ended_at_us: int = 0
    input_hash: str | None = None  # a step whose input was pushed: what it ran on, for its client to compare


@dataclass
class _Job:
    """An admitted job: its result to come (a retry of the same id waits for it), once running its task, and the
    program's bytes if this job brought them (other jobs for that program use this copy meanwhile)."""

    outcome: asyncio.Future
    run: asyncio.Task | None = None
    ticket: Ticket | None = None  # its place in the lanes, once its bytes are in
    upload: Upload | None = None
    charged: int = 0  # payload bytes charged to the worker's buffer budget, given back when the job ends
    awaits_push: str | None = None  # the session whose pushed input this step waits for (a cancel calls that off)
    pushed: bytes | None = None  # the pushed input it took (given back if the step is refused as busy: it is retried)


@dataclass
class _Inputs:
    program: bytes | None
    inputs: bytes | bytearray | "Spooled"
    input_hash: str


#: Streamed inputs at least this big are written to an unlinked file as they arrive (when the service has a spool
#: directory) and reach the executor as that file's descriptor: page cache, not the worker's heap.
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


class JobService:
    """Serves the job, run, settle, cancel, ping, info and prove doors of one worker."""

    def __init__(
        self,
        *,
        identity: Identity,
        executor,
        ledger: Ledger,
        admission: Admission,
        record: Callable[[], Any],
        corrupt_outputs: Callable[[bytes], bytes] | None = None,
        spool_dir: str | None = None,
        device: str = "cpu",
        peer_rate: float | None = None,
        corrupt_pieces: bool = False,
        session_limits: SessionLimits | None = None,
        corrupt_pushes: bool = False,
        drop_pushes: bool = False,
    ):
        """``device``: where speed challenges run (the executors' device: the speed a worker proves is theirs);
        ``peer_rate``: the most bytes a second it serves programs to other workers at (None: no cap)."""
        self.identity = identity
        self.device = device
        self.executor = executor
        self.admission = admission
        self.limits = admission.limits
        self.books = LedgerWriter(ledger)  # receipts are filed in batches, after the reply has gone
        # Finished results, kept for retries of the same job id; one client's up to its share of the bytes (its own
        # oldest go first: one big result, or many, must not push every other client's out).
        self.results: LRU[tuple[str, str], Outcome] = LRU(
            MAX_RECENT_RESULTS, self.limits.recent_results_bytes, owner=lambda key: key[0],
            share=self.limits.buffer_share)
        self.settlement = Settlement(self.books, find_receipt=self._recent_receipt, on_paid=admission.paid)
        # id(outcome) -> [streams writing it now, the client and address its bytes are held against] (held once)
        self._writing: dict[int, list] = {}
        # Private programs (Submit.private): hash -> the clients that sent its bytes. Only they may run it from this
        # worker's memory; it is never advertised nor written to disk, and anyone else must send the bytes.
        self._private: dict[str, set[str]] = {}  # bounded by _add_owner (never evicts a program still held)
        self._proof_digests: LRU[str, list[bytes]] = LRU(MAX_OPEN_PROOFS)  # client -> its last proof's row digests
        self._record = record
        self._corrupt_outputs = corrupt_outputs
        # Which admitted job runs next, at what price, and which batch job an interactive one stops (pure; see
        # gpunet.worker.lanes): a job waits for its turn there, and a Preempt stops the run of the job named.
        self.lanes = Lanes(admission.max_concurrent, admission.price_nano, admission.batch_price_nano)
        # The lanes' gauges, published a moment after a change rather than at every job's start and end (a dozen
        # gauge writes a job; a scrape comes every few seconds at most).
        self._count_lanes = Debounce(LANE_GAUGES_DELAY, lambda: metrics.count_lanes(self.lanes))
        self._turns: dict[Ticket, asyncio.Future] = {}  # waiting for a Start
        self._pause_timer: asyncio.TimerHandle | None = None
        self._leaving = False  # the drain ran out of time: running jobs are being stopped (stop_running)
        #: The latest jobs that ran here and how each ended, newest last (the dashboard shows them).
        self.recent: deque[dict] = deque(maxlen=RECENT_JOBS)
        self._by_ticket: dict[Ticket, _Job] = {}
        self._jobs: dict[tuple[str, str], _Job] = {}
        self.uploads = Uploads()
        self.spool_dir = spool_dir  # where big inputs are written as they arrive (None: kept in memory)
        self._rpc: RPC | None = None
        # Programs between workers (gpunet.worker.peers): pieces of what the disk cache holds, served to peers, and
        # programs this worker lacks fetched from them (set up once the network is there).
        disk = getattr(executor, "disk", None)
        self.piece_server = PieceServer(disk, peer_rate, coming=self._public_upload_coming,
                                        corrupt=corrupt_pieces) if disk is not None else None
        self.fetcher: Fetcher | None = None
        self.sessions = Sessions(session_limits or SessionLimits())
        self._sweeper: asyncio.Task | None = None
        self._session_steps: dict[tuple[str, str], asyncio.Future] = {}  # (client, session) -> its running step
        self._drops: set[asyncio.Future] = set()  # sessions' state being freed in executors
        self._sessions_paid = When(lambda: not self.sessions.owing)
        self.pushes = Pushes()  # session steps' inputs pushed by the previous span's worker (gpunet.worker.pushes)
        self._pushing: set[asyncio.Future] = set()  # this worker's outputs on their way to the next span's worker
        self._pushes_of: Counter[str] = Counter()  # ...of each client's sessions
        self._corrupt_pushes = corrupt_pushes  # FAULT INJECTION for tests: a pusher that lies to the next worker
        self._drop_pushes = drop_pushes  # FAULT INJECTION for tests: pushes lost on the way
        if corrupt_pushes:
            logger.warning("FAULT INJECTION: this worker pushes wrong inputs to the next span's worker")
        if drop_pushes:
            logger.warning("FAULT INJECTION: this worker pushes nothing to the next span's worker")

    def _public_upload_coming(self, program_hash: str) -> bool:
        upload = self.uploads.coming(program_hash)
        return upload is not None and not upload.private and program_hash not in self._private

    async def start(self, rpc: RPC) -> None:
        self._rpc = rpc
        await rpc.serve_stream(Door.JOB, self._handle_job)
        await rpc.serve_stream(Door.INFO, self._handle_info)
        await rpc.serve_unary(Door.PING, self._handle_ping)
        await rpc.serve_unary(Door.RUN, self._handle_run)
        await rpc.serve_unary(Door.SETTLE, self._handle_settle)
        await rpc.serve_unary(Door.CANCEL, self._handle_cancel)
        await rpc.serve_unary(Door.PROVE, self._handle_prove)
        await rpc.serve_unary(Door.PUSH, self._handle_push)
        self._sweeper = asyncio.create_task(self._expire_sessions())
        if self.piece_server is not None:
            await self.piece_server.start(rpc)
            self.fetcher = Fetcher(rpc, self.identity.peer_id)

    async def stop(self) -> None:
        self.admission.drain()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in list(self._pushing):
            task.cancel()
        if self._rpc is not None:
            await self._rpc.close()
        await self.settlement.close()

    def _recent_receipt(self, key: tuple[str, str]) -> Receipt | None:
        outcome = self.results.get(key)
        return outcome.receipt if outcome is not None else None

    # --- ping and info ---------------------------------------------------------------------------------------------

    async def _handle_ping(self, request: bytes, client_id: str) -> bytes:
        try:
            echo = protocol.decode(request, Ping).echo[:MAX_PING_BYTES]
        except GpunetError as e:
            return protocol.encode(Error.of(e))
        return protocol.encode(Pong(time.time(), echo))

    async def _handle_info(self, client_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           host: str = "") -> None:
        try:
            await protocol.read(reader, GetInfo, timeout=FRAME_TIMEOUT)
            await protocol.write(writer, Info(time.time(), self._record().to_wire()))
        except GpunetError as e:
            logger.debug("info request from %s failed: %s", client_id[-8:], e)
        finally:
            writer.close()

    async def _handle_prove(self, request: bytes, client_id: str) -> bytes:
        """A speed challenge (:mod:`gpunet.speedproof`), rationed by admission: multiply for the time asked and commit;
        or open the products the client picked from its last challenge."""
        try:
            message = protocol.decode(request, ProveSpeed, OpenProof)
            if isinstance(message, ProveSpeed):
                challenge = speedproof.Challenge(message.seed, message.n, message.seconds, message.dtype)
                record = self._record()
                claims = record.tflops if record is not None else {}
                if not speedproof.fits(claims, challenge.dtype, challenge.n):
                    dtype, n = speedproof.terms(claims)
                    raise JobRejected(f"this worker takes speed challenges of {n}x{n} {dtype} matrices (what its "
                                      f"claimed speed calls for), not {challenge.n}x{challenge.n} {challenge.dtype}")
                self.admission.screen_proof(client_id)
                self.admission.proof_started(client_id, message.seed, message.n)
                started = time.perf_counter()
                digests = await self._device_work(client_id, speedproof.prove, challenge, self.device, commits=True)
                logger.debug("Speed challenge from %s: %d products of %s %dx%d in %.3f s", client_id[-8:],
                             len(digests), challenge.dtype, challenge.n, challenge.n, time.perf_counter() - started)
                self._proof_digests.put(client_id, digests)
                return protocol.encode(SpeedCommitment(tuple(speedproof.commit(digests))))
            self.admission.screen_opening(client_id, message.seed, message.n, message.picks)
            digests = self._proof_digests.pop(client_id)  # opened once, whatever happens next
            if digests is None:
                raise JobRejected("that speed challenge is no longer held here (too many others since); ask again later")
            self.admission.opening_started(client_id)
            openings = await self._device_work(client_id, speedproof.open_products,
                                               speedproof.Challenge(message.seed, message.n), message.picks, digests,
                                               self.device)
            return protocol.encode(ProofOpening(tuple(openings)))
        except GpunetError as e:
            return protocol.encode(Error.of(e))
        except Exception as e:  # a device error (out of memory): the challenge fails, the worker goes on
            logger.warning("Speed challenge from %s failed here: %s", client_id[-8:], e)
            return protocol.encode(Error.of(JobFailed(f"speed challenge failed on this worker: {type(e).__name__}")))

    async def _device_work(self, client_id: str, fn, *args, commits: bool = False):
        """Run a challenge's work in a thread. Admission hears it has ended only when the thread has (a call cancelled
        by its client must not let the next challenge start while this one still holds the device)."""
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))

        def ended(done: asyncio.Future) -> None:
            ok = not done.cancelled() and done.exception() is None
            self.admission.proof_ended(client_id, len(done.result()) if commits and ok else None)

        work.add_done_callback(ended)
        return await asyncio.shield(work)

    # --- jobs: the stream door (any size) --------------------------------------------------------------------------

    async def _handle_job(self, client_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          host: str = "") -> None:
        self.admission.stream_opened()
        self.admission.came_from(client_id, host)
        try:
            submit = await protocol.read(reader, Submit, timeout=FRAME_TIMEOUT)
            payloads = _StreamPayloads(reader, writer, self.limits, self.spool_dir, self.fetcher)
            outcome = await self._execute(client_id, submit, payloads, reader, host)
            await self._reply(outcome, writer, client_id, host)
            if outcome.receipt is not None:  # a session step billed later has nothing to settle now
                await self._settle_from_stream(client_id, outcome.receipt, reader)
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

    async def _settle_from_stream(self, client_id: str, receipt: Receipt, reader) -> None:
        """Wait briefly for the countersignature on the stream; without it the receipt stays in the unpaid list."""
        try:
            message = await protocol.read(reader, Countersign, Refuse, timeout=COUNTERSIGN_TIMEOUT)
        except ProtocolError:
            logger.warning("Client %s did not countersign job %s: recorded as unpaid", client_id[-8:], receipt.job_id[:12])
            # Its countersignature may still come with a later job or batch: awaited with the unary door's, not
            # looked up among the kept results (they are for retries, and others' results push them out).
            self.settlement.expect(client_id, receipt)
            return
        try:
            if message.job_id != receipt.job_id:
                raise ProtocolError("the settlement names another job than the one delivered on this stream")
            self.settlement.settle(client_id, message, receipt)
            self.books.flush()  # off the job's path already (the result has gone): make the payment durable now
        except GpunetError as e:
            logger.warning("Bad settlement from %s for job %s: %s", client_id[-8:], receipt.job_id[:12], e)

    # --- jobs: the unary door (small jobs whose program the worker holds: one round trip) ----------------------------

    async def _handle_run(self, request: bytes, client_id: str) -> bytes:
        try:
            submit = protocol.decode(request, Submit)
            if submit.settle_malformed:
                logger.warning("Ignored %d malformed countersignature(s) from %s (the job itself is served)",
                               submit.settle_malformed, client_id[-8:])
            self.settlement.ride_along(client_id, submit.settle)  # checked and filed after the reply
            host = self.admission.unary_host(client_id)
            if host is None:
                raise _NeedsStream()  # the unary door does not see the peer's address: the stream door does
            outcome = await self._execute(client_id, submit, _UnaryPayloads(), None, host)
            if len(outcome.outputs) > UNARY_OUTPUT_BYTES:
                return protocol.encode(UseStream())  # the result waits in the recent results for the stream retry
            if outcome.receipt is not None:
                self.settlement.expect(client_id, outcome.receipt)  # countersigned by a later call
            return protocol.encode(Result(len(outcome.outputs), _receipt_bytes(outcome), outcome.outputs,
                                          outcome.input_hash))
        except (_NeedsStream, ProgramNotCached):  # the stream door can resend the program
            return protocol.encode(UseStream())
        except GpunetError as e:
            return protocol.encode(Error.of(e, queue=self.admission.queue_length))
        except Exception as e:
            logger.exception("Unexpected error while serving %s", client_id[-8:])
            return protocol.encode(Error.of(JobFailed(f"worker error: {type(e).__name__}")))

    async def _handle_settle(self, request: bytes, client_id: str) -> bytes:
        try:
            message = protocol.decode(request, Countersign, Refuse, SettleBatch)
            if isinstance(message, SettleBatch):
                if message.malformed:
                    logger.warning("Ignored %d malformed countersignature(s) from %s", message.malformed, client_id[-8:])
                await self.settlement.batch(client_id, message.items)
            else:
                self.settlement.settle(client_id, message)
                self.books.flush()
            return protocol.encode(Ok())
        except GpunetError as e:
            return protocol.encode(Error.of(e))

    async def _handle_cancel(self, request: bytes, client_id: str) -> bytes:
        """A client stops one of its own jobs (queued or running: see Executor.run for how a run stops), or ends one
        of its sessions (its state is freed)."""
        try:
            message = protocol.decode(request, Cancel, CloseSession)
            if isinstance(message, CloseSession):
                self.pushes.forget(client_id, message.session_id)  # a step waiting for a push stops waiting
                step = self._session_steps.get((client_id, message.session_id))
                if step is not None:  # a step still running (its answer may be on its way): close once it is done
                    await asyncio.wait([step], timeout=COUNTERSIGN_TIMEOUT)
                ended = self.sessions.close(client_id, message.session_id, message.received)
                receipt = None
                if ended is not None:
                    self._count_sessions()
                    receipt = self._bill(ended)
                    self._drop([ended.key])
                return protocol.encode(SessionClosed(ended is not None, receipt.to_bytes() if receipt else None))
            job = self._jobs.get((client_id, message.job_id))
            if job is not None and job.awaits_push is not None:  # a step still waiting for its input stops waiting
                self.pushes.call_off(client_id, job.awaits_push)
                return protocol.encode(Ok(cancelled=True))
            # Only a job still running can be stopped (cancel() is False for one that has just finished).
            stopped = job is not None and job.run is not None and job.run.cancel()
            return protocol.encode(Ok(cancelled=stopped))
        except GpunetError as e:
            return protocol.encode(Error.of(e))

    async def _expire_sessions(self) -> None:
        """Sessions idle past their time lose their state (checked every second; a step in progress never expires)."""
        while True:
            await asyncio.sleep(1.0)
            gone = self.sessions.expired(time.monotonic())
            if gone:
                self._count_sessions()
                for ended in gone:
                    self._bill(ended)  # work done is owed, whether or not its client comes back to pay
                logger.info("%d session(s) expired; their state is freed (%d session(s), %d bytes of state held now)",
                            len(gone), len(self.sessions), self.sessions.held_bytes)
                self._drop([ended.key for ended in gone])

    def _drop(self, keys: list[str]) -> None:
        """Free sessions' state in the executors holding it, in the background (an executor busy with a long job
        frees it when that job is done; nothing waits for it meanwhile)."""
        async def drop() -> None:
            try:
                await self.executor.drop_sessions(keys)
            except GpunetError:  # the pool is closing: the state goes with its processes
                pass

        task = asyncio.ensure_future(drop())
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)

    def _count_sessions(self) -> None:
        metrics.SESSIONS.set(len(self.sessions))
        metrics.SESSION_BYTES.set(self.sessions.held_bytes)
        self._sessions_paid.check()

    def sessions_closed(self) -> asyncio.Future:
        """Resolves once no session holds steps not billed yet. A client told that this worker drains moves its span
        and closes the session here, which bills those steps: a leaving worker waits for that."""
        return self._sessions_paid.wait()

    def end_sessions(self) -> int:
        """Leaving: end the sessions still open, signing the tabs their clients did not close (owed, not awaited: they
        stay in `gpunet ledger unpaid` until their clients pay). Returns how many tabs were signed."""
        ended = self.sessions.end_all()
        self._count_sessions()
        signed = sum(self._bill(e, await_payment=False) is not None for e in ended)
        self._drop([e.key for e in ended])
        return signed

    def _busy(self, why: str = "worker queue is full") -> WorkerBusy:
        metrics.JOBS.labels("busy").inc()
        return WorkerBusy(why, self.admission.queue_length)

    # --- jobs: what both doors share -------------------------------------------------------------------------------

    async def _execute(self, client_id: str, submit: Submit, payloads, reader, host: str = "") -> Outcome:
        """Admit, de-duplicate and run one job (see _admit_and_run)."""
        if submit.session is None:
            return await self._admit_and_run(client_id, submit, payloads, reader, host)
        # A session step moves its session's state on in the executor: once begun, it is seen through with its
        # bookkeeping, whatever becomes of the door that carried it (the daemon cancels a unary call whose caller
        # has gone), and its answer waits in the recent results for the client's retry.
        step = asyncio.ensure_future(self._admit_and_run(client_id, submit, payloads, reader, host))
        step.add_done_callback(lambda done: done.cancelled() or done.exception())  # nobody may be left to ask
        return await asyncio.shield(step)

    async def _admit_and_run(self, client_id: str, submit: Submit, payloads, reader, host: str = "") -> Outcome:
        """Admit, de-duplicate and run one job; WorkerBusy when the worker (or this client's share of it) is full.

        A job whose bytes must still arrive takes no queue place while they do (see :mod:`~gpunet.worker.admission`):
        it counts as an upload of its client and address, its payload is charged to the buffer budget before it is
        read, and it is admitted once the bytes are in."""
        key = (client_id, submit.job_id)
        self.admission.screen(client_id, submit, host=host)
        known = self.results.get(key)
        if known is not None:  # a retry of a finished job: same result, same receipt, no second bill
            return known
        if key in self._jobs:  # a retry while the first run is still going: wait for it
            return await asyncio.shield(self._jobs[key].outcome)
        self.admission.check_share(client_id, host)  # (a retry above adds nothing: its result is held already)
        # One job, one receipt, ever: a second receipt for a client's job id would read as fraud by this worker (and
        # a run nobody pays for). Job ids are each client's own: another client using the same id (guessed, or seen
        # while running a replica) is a different job, so it can neither block nor take over this one. (A session
        # step is billed in its session's tabs, under job ids no step can take: no receipt is kept under its own.)
        if submit.session is None and self.books.signed(client_id, submit.job_id) is not None:
            raise JobRejected(f"job id {submit.job_id[:16]} was already run here and its result is no longer kept; "
                              "use a fresh job id")
        if tabs.parse(submit.job_id) is not None:
            raise JobRejected("job ids of the form <session>.<nonce>.<first>-<last> name session tabs; use another")
        if submit.session is not None and submit.lane != INTERACTIVE:
            raise JobRejected("session steps are interactive: a step stopped for another job would lose the state")
        if not self.admission.has_room(client_id, submit.lane):  # busy or draining first: no use switching doors
            raise self._busy()
        if submit.deadline is not None:
            self._check_deadline(submit)
        need_program = not self._holds_for(client_id, submit.program)
        pushed = submit.session is not None and submit.session.input_from is not None  # its input comes from a peer
        if pushed:
            self._may_wait_for_push(client_id, submit, need_program)
        payloads.precheck(submit, need_program)
        uploading = need_program or submit.inputs is None
        if uploading and not self.admission.begin_upload(client_id, host):
            raise self._busy("this client (or its address) has as many uploads in progress as this worker takes")
        job = self._jobs[key] = _Job(asyncio.get_running_loop().create_future())
        admitted, got, session = False, None, None
        try:
            if pushed:
                submit = await self._pushed_input(client_id, job, submit)
            try:
                got = await self._receive(client_id, job, submit, payloads, need_program,
                                          charge=partial(self._charge, job, client_id, host))
            finally:
                if uploading:
                    self.admission.upload_done(client_id, host)
            # Once its bytes are here: a slow upload must not hold a session place (or its reserved memory).
            session = self._begin_session(client_id, submit, host)
            if session is not None:
                self._session_steps[(client_id, submit.session.id)] = job.outcome
            metrics.BYTES_IN.inc(len(got.inputs) + (len(got.program or b"") if job.upload else 0))
            owners = self._private.get(submit.program)
            marks_private = submit.private and submit.program not in self.executor.disk  # public stays public
            if got.program is not None and (owners is not None and client_id not in owners or marks_private):
                # The bytes are the capability, so they must be the program's (an executor holding it in memory
                # would otherwise run it whatever was sent).
                if await asyncio.to_thread(content_hash, got.program) != submit.program:
                    raise JobRejected("the program bytes sent do not match the program's hash")
                # Before it runs: once an executor holds it, the entry is what keeps it from others.
                self._add_owner(submit.program, client_id)
            if not self.admission.admit(client_id, submit.lane):
                raise self._busy()
            admitted = True
            outcome = await self._run(key, job, submit, got, reader, host, session)
            if pushed:
                outcome.input_hash = got.input_hash
            if session is not None:
                billed = self.sessions.done(
                    client_id, submit.session.id, outcome.state_bytes, time.monotonic(), input_hash=got.input_hash,
                    output_hash=sha256_hex(outcome.outputs), flops=outcome.flops, wall_time_us=outcome.wall_time_us,
                    started_at_us=outcome.started_at_us, ended_at_us=outcome.ended_at_us,
                    max_price=submit.max_price, close=submit.session.close)
                self._count_sessions()
                # The receipt of a tab this step filled, or of the session it ended, goes with its answer.
                if isinstance(billed, Ended):
                    outcome.receipt = self._bill(billed, await_payment=False)
                elif billed is not None:
                    outcome.receipt = self._sign_tab(client_id, submit.session.id, submit.program, billed,
                                                     submit.max_price, host)
                if not submit.session.close and not self.sessions.is_open(client_id, submit.session.id):
                    # Its client closed it while this step ran: the state goes, and the tab (only the steps it said
                    # it received) is awaited from it like a closed session's.
                    self._drop([session["key"]])
                    if outcome.receipt is not None:
                        self.settlement.expect(client_id, outcome.receipt)
            job.outcome.set_result(outcome)
            if submit.session is not None and submit.session.push_to is not None:
                self._push_on(client_id, submit.session.push_to, outcome.outputs)
        except BaseException as e:
            # Busy for a moment: its client asks again (the step did not run), and the pushed input waits for that.
            busy = isinstance(e, WorkerBusy) and not isinstance(e, WorkerDraining)
            if busy and job.pushed is not None:
                self.pushes.offer(submit.session.input_from, client_id, submit.session.id, submit.session.step,
                                  job.pushed, time.monotonic())
            if (not busy and submit.session is not None and submit.session.push_to is not None
                    and self.sessions.is_open(client_id, submit.session.id)):
                self._push_on(client_id, submit.session.push_to, None)  # the next span's worker asks the client
            if session is not None:
                ended = self.sessions.failed(
                    client_id, submit.session.id, lost=isinstance(e, SessionLost)
                    or (submit.session.step > 0 and not self.executor.holds_session(session["key"])))
                self._count_sessions()
                if ended is not None:  # its client closed it while this step ran: what it received is owed
                    self._bill(ended)
                    self._drop([ended.key])
            job.outcome.set_exception(e if isinstance(e, GpunetError) else JobFailed(f"job did not finish: {type(e).__name__}"))
            job.outcome.exception()  # retrieved: a waiting retry gets it, an unwatched one does not warn
            raise
        finally:
            del self._jobs[key]
            if session is not None:
                self._session_steps.pop((client_id, submit.session.id), None)
            if job.upload is not None:  # run or not, the program is cached now or will not be from this copy
                self.uploads.end(job.upload)
            if admitted:
                self.admission.released(client_id, submit.lane)
            self.admission.release_bytes(job.charged, client_id, host)
            # A failure's traceback keeps this frame (and the job's future keeps the failure): let go of the payload
            # here, so an abandoned upload's memory is freed now, not whenever the cycle collector runs.
            if got is not None and isinstance(got.inputs, bytearray):
                _release(got.inputs)
            elif got is not None and isinstance(got.inputs, Spooled):
                got.inputs.close()  # unlinked already: closing gives the disk space back
            got = job.upload = None
        self.results.put(key, outcome, len(outcome.outputs))
        return outcome

    # --- pushed steps: span to span without the client in between (docs/sessions.md) --------------------------------

    async def _handle_push(self, request: bytes, sender_id: str) -> bytes:
        """Another worker's output for the next step of a session held here. Taken only for a session open here (so
        only bounded room is spent on it); the step itself says which worker's push it takes."""
        try:
            self._offer(sender_id, protocol.decode(request, Push))
            return protocol.encode(Ok())
        except GpunetError as e:
            return protocol.encode(Error.of(e))

    def _offer(self, sender_id: str, push: Push) -> None:
        if not self.sessions.is_open(push.client, push.session):
            raise SessionLost(f"session {push.session[:16]} is not held here")
        if push.inputs is not None:
            protocol.check_payload_size(len(push.inputs), self.limits.max_input_bytes, "pushed inputs")
        if not self.pushes.offer(sender_id, push.client, push.session, push.step, push.inputs, time.monotonic()):
            raise WorkerBusy("no room for more pushed inputs for this session here; the step will ask its client")

    def _may_wait_for_push(self, client_id: str, submit: Submit, need_program: bool) -> None:
        """A pushed step waits only for a session held here (so what waits is bounded by the sessions), whose program
        is here (else it would be sent again with the program, and its input with it)."""
        if not self.sessions.is_open(client_id, submit.session.id):
            raise SessionLost(f"session {submit.session.id[:16]} is not held here")
        if need_program:
            raise ProgramNotCached(submit.program)

    async def _pushed_input(self, client_id: str, job: _Job, submit: Submit) -> Submit:
        """The step with the input its client said another worker pushes here; JobRejected (the client then sends
        it itself) if it does not come."""
        step = submit.session
        job.awaits_push = step.id
        try:
            data = await self.pushes.take(step.input_from, client_id, step.id, step.step,
                                          timeout=submit.timeout if submit.deadline is None
                                          else min(submit.timeout, submit.deadline - time.time()))
        finally:
            job.awaits_push = None
        if data is None:
            raise JobRejected(f"the input of session step {step.step} did not come from worker "
                              f"{step.input_from[-8:]}; send it with the step")
        job.pushed = data
        return replace(submit, inputs=data, inputs_size=len(data))

    def _push_on(self, client_id: str, to: PushTo, outputs: bytes | None) -> None:
        """Send a step's output on to the next span's worker (in the background: the client's answer does not wait
        for it); None, or an output that is not one tensor small enough, tells it to ask the client instead."""
        if self._drop_pushes:
            return
        data = _as_next_input(outputs) if outputs is not None else None
        if data is not None and self._corrupt_pushes:
            data = data[:-1] + bytes([data[-1] ^ 1])
        push = Push(client_id, to.session, to.step, data)
        if to.peer == self.identity.peer_id:  # both spans here (no other worker could take one)
            try:
                self._offer(to.peer, push)
            except GpunetError as e:
                logger.debug("A session step's output was not passed on here: %s", e)
            return
        if (len(self._pushing) >= MAX_PUSHING
                or self._pushes_of[client_id] >= MAX_PUSHING_PER_SESSION * self.sessions.limits.max_per_client):
            return  # the step there asks its client
        task = asyncio.ensure_future(self._send_push(to.peer, push))
        self._pushing.add(task)
        self._pushes_of[client_id] += 1

        def sent(done: asyncio.Future) -> None:
            self._pushing.discard(done)
            self._pushes_of[client_id] -= 1
            if not self._pushes_of[client_id]:
                del self._pushes_of[client_id]

        task.add_done_callback(sent)

    async def _send_push(self, peer_id: str, push: Push) -> None:
        try:
            async with asyncio.timeout(PUSH_TIMEOUT):
                reply = await self._rpc.call(peer_id, Door.PUSH, push, Ok, Error)
            if isinstance(reply, Error):
                logger.debug("Worker %s did not take a pushed input: %s", peer_id[-8:], reply.message)
        except (GpunetError, TimeoutError) as e:  # its step asks the client for the input instead
            logger.debug("Could not push a session step's output to worker %s: %s", peer_id[-8:], e)

    def _sign_tab(self, client_id: str, session_id: str, program: str, tab, max_price: int | None,
                  host: str = "") -> Receipt | None:
        """One receipt for a tab of session steps (gpunet.ledger.tabs), owed until countersigned like any (None, and
        logged, if one of that id exists: the worker's nonce makes that a bug, and one job id has one receipt)."""
        if self.books.signed(client_id, tab.job_id(session_id)) is not None:
            logger.error("A receipt for %s exists already; these steps are not billed again", tab.job_id(session_id))
            return None
        receipt = sign_as_worker(
            self.identity, job_id=tab.job_id(session_id), client_id=client_id, program_hash=program,
            input_hash=tab.input_chain, output_hash=tab.output_chain, flops=tab.flops,
            wall_time_us=tab.wall_time_us, price=self.admission.price_nano, max_price=max_price,
            started_at_us=tab.started_at_us, ended_at_us=tab.ended_at_us)
        self.books.record_unpaid(receipt)
        self.admission.delivered(client_id, receipt.job_id, host)
        return receipt

    def _bill(self, ended, await_payment: bool = True) -> Receipt | None:
        """The tab of a session that ended (closed, expired): signed, and awaited from its client by a later call
        (unless ``await_payment`` is False: the worker is leaving)."""
        if ended.disclaimed is not None:
            self._disclaimed(ended)
        if ended.tab is None:
            return None
        try:
            receipt = self._sign_tab(ended.client_id, ended.session_id, ended.program, ended.tab, ended.max_price,
                                     ended.host)
        except GpunetError as e:  # never the end of the sweeper, or of the close that asked
            logger.error("Could not bill the last steps of session %s: %s", ended.session_id[:12], e)
            return None
        if receipt is not None and await_payment:
            self.settlement.expect(ended.client_id, receipt)
        return receipt

    def _disclaimed(self, ended) -> None:
        """Steps that ran here after those the closing client said it received: not billed (an answer lost on the
        way is this worker's loss), but noted as unpaid work, and counted against the client (Admission.disclaimed),
        so that saying "received nothing" cannot get an open tab's work free again and again. Not as an unpaid
        receipt: an honest client that lost one answer would then lose the unary door here for the hour."""
        rest = ended.disclaimed
        job_id = rest.job_id(ended.session_id)
        logger.warning("Client %s closed session %s saying it did not receive %d step(s) that ran here; not billed",
                       ended.client_id[-8:], ended.session_id[:12], rest.steps)
        self.books.record_unbilled(Unbilled(
            ended.client_id, job_id, "disclaimed", f"its client said it did not receive steps {rest.first}-{rest.last}",
            rest.flops, ended.program, INTERACTIVE))
        self.admission.disclaimed(ended.client_id, ended.host)

    def _begin_session(self, client_id: str, submit: Submit, host: str = "") -> dict | None:
        """A session step may run (its client's, in order, within the limits): what the executor is told of it."""
        step = submit.session
        if step is None:
            return None
        room = self.sessions.begin(client_id, step.id, submit.program, step.step, step.ttl, time.monotonic(),
                                   host, step.state_bytes)
        self.pushes.call_off(client_id, step.id)  # a step of it still waiting for a push is overtaken
        return {"key": Sessions.key(client_id, step.id), "step": step.step, "fresh": step.fresh, "close": step.close,
                "room": room}

    def _add_owner(self, program_hash: str, client_id: str) -> None:
        """Record that ``client_id`` holds a private program's bytes. Entries are never evicted while an executor
        may still hold the program (an evicted one would make it public); when the table is full, entries of
        programs no longer held are dropped, and if none is, the job is refused."""
        owners = self._private.get(program_hash)
        if owners is None:
            if len(self._private) >= MAX_PRIVATE_PROGRAMS:
                for gone in [h for h in self._private if not self.executor.has_program(h)]:
                    del self._private[gone]
            if len(self._private) >= MAX_PRIVATE_PROGRAMS:
                raise JobRejected("this worker holds as many private programs as it keeps track of; try another")
            owners = self._private[program_hash] = set()
        owners.add(client_id)

    def _holds_for(self, client_id: str, program_hash: str) -> bool:
        """Whether this client's job may run without sending the program: it is held here, and not private to
        others."""
        owners = self._private.get(program_hash)
        if owners is not None and client_id not in owners:
            return False
        return self.executor.has_program(program_hash)

    def _charge(self, job: _Job, client_id: str, host: str, nbytes: int, dry: bool = False) -> None:
        self.admission.charge(nbytes, client_id, host, dry=dry)
        if not dry:
            job.charged += nbytes

    async def _receive(self, client_id: str, job: _Job, submit: Submit, payloads, need_program: bool,
                       charge: Callable[[int], None]) -> _Inputs:
        """What the job lacks, each program crossing the link once: a job whose program is already on its way in (or
        being loaded) for another job uses that copy instead of asking its own client for one more."""
        tried: set[Upload] = set()
        while need_program:
            upload = self.uploads.coming(submit.program)
            if upload is None or upload in tried:
                break  # none on its way (or only one we gave up on): this job brings its own
            if (submit.program in self._private or upload.private) and upload.client_id != client_id:
                break  # another client's copy of a private program: holding the weights is what lets one run it
            tried.add(upload)
            program = await upload.share()
            if program is not None:
                got = await payloads.fetch(submit, need_program=False, charge=charge)
                got.program = program
                return got
            # That copy failed or is too slow. The program may have been loaded meanwhile, or another job may have
            # taken over bringing it: look again.
            need_program = not self._holds_for(client_id, submit.program)
        if not need_program:
            return await payloads.fetch(submit, need_program=False, charge=charge)
        job.upload = self.uploads.begin(submit.program, client_id, private=submit.private)
        got = await payloads.fetch(submit, need_program=True, charge=charge)
        job.upload.arrived(got.program)
        return got

    async def _run(self, key: tuple[str, str], job: _Job, submit: Submit, got: _Inputs, reader,
                   host: str = "", session: dict | None = None) -> Outcome:
        """Run a job, stoppable while queued or running: by a cancel call from its client, or (stream door) by the
        client hanging up. Either way the run is stopped (see Executor.run), so abandoned work stops using the machine.

        A session step is the exception to the hang-up: it runs to its end (within its time limit). Its client asks
        for it again (a stream can break on the way without anyone leaving) and gets the answer it missed; cut short,
        the step would cost the span a move and a replay elsewhere."""
        job.ticket = Ticket(key[0], submit.lane, submit.max_price, host=host, job=key[1])
        self._by_ticket[job.ticket] = job
        job.run = asyncio.ensure_future(self._run_now(key, submit, got, host, session, job.ticket))
        # The client sends nothing between its payload and our result, so any byte or EOF here means it is gone.
        gone = asyncio.ensure_future(reader.read(1)) if reader is not None else None
        tasks = {job.run, gone} if gone is not None else {job.run}
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if session is not None and not job.run.done():
                await asyncio.wait([job.run])
        finally:
            for task in tasks:  # the job if still running (a hang-up, a cancel), and always the watch
                task.cancel()
            # Let the job give back its slot and executor before we answer; the reader is free again only once the
            # watch has really ended. A second cancel of ours must not leave either behind.
            await wait_out(*tasks)
            self._by_ticket.pop(job.ticket, None)
        stopped = job.run.cancelled() or isinstance(job.run.exception(), JobPreempted)
        if stopped and job.ticket.preempted and self._leaving:
            raise self._leaving_error()
        if stopped and job.ticket.preempted and self.admission.paused is not None:
            raise self.admission.pause_error()  # the owner took the machine back: run it elsewhere
        if job.run.cancelled():
            if job.ticket.preempted:
                raise JobPreempted("an interactive job needed this worker's slot: the job was stopped, not billed; "
                                   "run it again elsewhere or later", self.admission.queue_length)
            raise JobFailed("job stopped before it finished: its client cancelled it or went away")
        return job.run.result()

    async def _run_now(self, key: tuple[str, str], submit: Submit, got: _Inputs, host: str = "",
                       session: dict | None = None, ticket: Ticket | None = None) -> Outcome:
        client_id, job_id = key
        ticket = ticket or Ticket(client_id, submit.lane, submit.max_price, host=host, job=job_id)
        await self._turn(ticket, submit.deadline)
        timeout = submit.timeout
        if submit.deadline is not None:  # due by then: it never runs past it
            timeout = min(timeout, submit.deadline - time.time())
            if timeout <= 0:
                self._apply(self.lanes.ended(ticket, 0.0))
                raise DeadlineUnreachable("the job's deadline passed as it was about to start")
        if session is not None and session["step"] > 0:  # its executor must be free: lower lanes' work there stops
            for other in self.executor.running_where(session["key"]):
                if other.lane != INTERACTIVE:
                    self._stop_run(other)
        self.admission.started()
        done = False
        started, clock = time.time(), time.monotonic()
        logger.debug("Running job %s for client %s (%s lane)", job_id[:12], client_id[-8:], ticket.lane)
        extra: dict[str, Any] = {"session": session} if session is not None else {}
        dry = DryRun()  # what its dry run took, whatever happens (see _dry_run_cost)
        try:
            with metrics.JOB_SECONDS.time():
                # ProgramNotCached (evicted since admission) reaches the client as "not_cached": it resends the program.
                # Tagged with its ticket: the pool can stop it (preempted, paused) and say where it runs.
                result = await self.executor.run(submit.program, got.program, got.inputs, timeout=timeout,
                                                 private=submit.private or submit.program in self._private,
                                                 tag=ticket, spare_sessions=session is None, dry=dry, **extra)
            done = True
            self._dry_run_cost(client_id, host, dry, billed=True)
        except (ExecutorDied, JobTimeout) as e:  # the job cost this worker its executor: counted against its client
            metrics.JOBS.labels(type(e).__name__).inc()
            self._dry_run_cost(client_id, host, dry)
            self.admission.stopped_running(client_id, weight=CRASH_WEIGHT if isinstance(e, ExecutorDied) else 1,
                                           host=host)
            if isinstance(e, ExecutorDied):
                logger.warning("Job %s for client %s killed its executor: %s", job_id[:12], client_id[-8:], e)
            self._unbilled(key, submit, "timed_out" if isinstance(e, JobTimeout) else "failed", str(e))
            raise
        except JobPreempted:  # stopped at a node boundary (the worker's doing): nothing counts against its client
            self._preempted(key, submit)
            raise
        except GpunetError as e:
            metrics.JOBS.labels(type(e).__name__).inc()
            self._dry_run_cost(client_id, host, dry)
            if isinstance(e, JobFailed) and not isinstance(e, SessionLost):  # it ran, and broke: the job's own error
                self._unbilled(key, submit, "failed", str(e))
                if ticket.victim is not None:  # another client's job was stopped for one that fails: not free
                    self.admission.stopped_running(client_id, host=host)
            raise
        except asyncio.CancelledError:
            if ticket.preempted:  # the worker's choice, not the client's doing: nothing counts against it
                self._preempted(key, submit)
                raise
            metrics.JOBS.labels("cancelled").inc()
            self._dry_run_cost(client_id, host, dry)
            self.admission.stopped_running(client_id, host=host)
            logger.info("Job %s for client %s stopped while running (cancelled, or the client went away)",
                        job_id[:12], client_id[-8:])
            self._unbilled(key, submit, "cancelled", "its client cancelled it or went away while it ran")
            raise
        finally:
            self.admission.ended(done)
            self._apply(self.lanes.ended(ticket, time.monotonic() - clock))
        ended = max(time.time(), started)  # a clock stepped back mid-job must not make the receipt unsignable
        outputs = result.outputs if self._corrupt_outputs is None else self._corrupt_outputs(result.outputs)
        if submit.session is not None:  # billed by its session's tab (see _execute)
            metrics.JOBS.labels("done").inc()
            return Outcome(outputs, None, result.state_bytes, int(result.flops), int(result.wall_time * 1e6),
                           int(started * 1e6), int(ended * 1e6))
        receipt = sign_as_worker(
            self.identity,
            job_id=job_id,
            client_id=client_id,
            program_hash=submit.program,
            input_hash=got.input_hash,
            output_hash=sha256_hex(outputs),
            flops=int(result.flops),
            wall_time_us=int(result.wall_time * 1e6),
            price=ticket.price,
            max_price=submit.max_price,
            started_at_us=int(started * 1e6),
            ended_at_us=int(ended * 1e6),
            lane=ticket.lane,
        )
        self.books.record_unpaid(receipt)  # until the countersignature arrives, this is work the client owes
        self.admission.delivered(client_id, job_id, host)
        self._ran(key, ticket.lane, "done", receipt)
        metrics.JOBS.labels("done").inc()
        logger.debug("Job %s for client %s done in %.2f s (%.3g GFLOP)", job_id[:12], client_id[-8:],
                     ended - started, result.flops / 1e9)
        return Outcome(outputs, receipt)

    # --- lanes: whose turn it is -------------------------------------------------------------------------------------

    async def _turn(self, ticket: Ticket, deadline: float | None) -> None:
        """Wait until the lanes start this job (at most until its deadline)."""
        if self._leaving:
            raise self._leaving_error()
        if self.admission.paused is not None:
            raise self.admission.pause_error()
        turn = self._turns[ticket] = asyncio.get_running_loop().create_future()
        try:
            self._apply(self.lanes.enqueue(ticket))
            if deadline is None:
                await turn
            else:
                try:
                    async with asyncio.timeout(deadline - time.time()):
                        await turn
                except TimeoutError:
                    raise DeadlineUnreachable("the job's deadline passed before a slot here was free") from None
        except BaseException:
            # Withdrawn while waiting (its client went away, its deadline passed), or started at the very moment it
            # was cancelled: either way its place goes to the next job.
            self._apply(self.lanes.ended(ticket, 0.0) if ticket.running else self.lanes.withdraw(ticket))
            raise
        finally:
            self._turns.pop(ticket, None)

    async def run_own(self, owner_id: str, program_hash: str, program: bytes, inputs: bytes):
        """The volunteer's own work (gpunet.worker.background), in the background lane: it waits for a slot nothing
        paying wants, and any paying job stops it (JobPreempted). Returns the executor's RunResult."""
        ticket = Ticket(owner_id, BACKGROUND, job="background")
        job = _Job(asyncio.get_running_loop().create_future(), ticket=ticket)
        job.outcome.cancel()  # nobody waits on it: a background run is not a client's job
        job.run = asyncio.ensure_future(self._run_own(ticket, program_hash, program, inputs))
        self._by_ticket[ticket] = job
        try:
            await asyncio.wait([job.run])
        finally:
            if not job.run.done():  # our caller stops (the worker leaves): so does the run
                job.run.cancel()
                await asyncio.wait([job.run])
            self._by_ticket.pop(ticket, None)
        if job.run.cancelled():
            raise JobPreempted("a paying job needed the slot")
        return job.run.result()

    async def _run_own(self, ticket: Ticket, program_hash: str, program: bytes, inputs: bytes):
        await self._turn(ticket, None)
        clock = time.monotonic()
        try:
            if self.executor.has_program(program_hash):
                try:
                    return await self.executor.run(program_hash, None, inputs, private=True, tag=ticket)
                except ProgramNotCached:  # another executor holds it; this one needs the bytes
                    pass
            return await self.executor.run(program_hash, program, inputs, private=True, tag=ticket)
        finally:
            self._apply(self.lanes.ended(ticket, time.monotonic() - clock))

    def _apply(self, actions: list[Action]) -> None:
        """Carry out what the lanes decided: wake a job whose turn it is, stop one preempted."""
        for action in actions:
            if isinstance(action, Start):
                turn = self._turns.get(action.ticket)
                if turn is not None and not turn.done():
                    turn.set_result(None)
            elif isinstance(action, Blame):  # it had another job stopped, then left: as costly as a cancel
                self.admission.stopped_running(action.ticket.client, host=action.ticket.host)
            else:
                self._stop_run(action.ticket)
        if actions:
            self._count_lanes.poke()

    def _preempted(self, key: tuple[str, str], submit: Submit) -> None:
        if self._leaving:
            metrics.JOBS.labels("drained").inc()
            self._unbilled(key, submit, "drained", "stopped: this worker left the network before it finished")
            return
        if self.admission.paused is not None:
            metrics.JOBS.labels("paused").inc()
            self._unbilled(key, submit, "paused", f"stopped: this worker paused ({self.admission.paused})")
            return
        metrics.JOBS.labels("preempted").inc()
        logger.info("Batch job %s for client %s stopped for an interactive job (not billed; its client runs it again)",
                    key[1][:12], key[0][-8:])
        self._unbilled(key, submit, "preempted", "stopped for an interactive job; its client runs it again")

    def _dry_run_cost(self, client_id: str, host: str, dry: DryRun, billed: bool = False) -> None:
        """Count a dry run's time against its client like stopped jobs (Admission.dry_ran); one stopped before it
        ended (the run timed out or was cancelled) counts what it may have been."""
        seconds = dry.cost(time.monotonic())
        if seconds and self.admission.dry_ran(client_id, seconds, billed=billed, host=host):
            logger.info("A dry run for client %s took %.2f s (%s): counted against it", client_id[-8:], seconds,
                        "billed" if billed else "not billed")

    def _unbilled(self, key: tuple[str, str], submit: Submit, reason: str, detail: str) -> None:
        """Note work started here that will not be paid, and why (``gpunet earnings`` lists it)."""
        self.books.record_unbilled(Unbilled(key[0], key[1], reason, detail, 0, submit.program, submit.lane))
        self._ran(key, submit.lane, reason)

    def _ran(self, key: tuple[str, str], lane: str, outcome: str, receipt: Receipt | None = None) -> None:
        """One line of the dashboard's recent jobs; one not billed has no start or price, and earned nothing."""
        self.recent.append({"job_id": key[1], "client_id": key[0], "lane": lane, "outcome": outcome,
                            "ended_at": time.time(),
                            "started_at": receipt.started_at_us / 1e6 if receipt is not None else None,
                            "price": receipt.price if receipt is not None else None,
                            "amount": receipt.amount if receipt is not None else 0,
                            "flops": receipt.flops if receipt is not None else 0})

    def _stop_run(self, ticket: Ticket) -> None:
        """Stop a running job the worker no longer wants to run (preempted, or the owner paused the worker): at its
        program's next node, the executor serving on; one op that runs long is given STOP_GRACE, then the run is
        cancelled, which kills the process (a warm spare takes its place), unless it holds sessions' state: there the
        stop word alone must do (Executor.run)."""
        job = self._by_ticket.get(ticket)
        if job is None or job.run is None or job.run.done():
            return
        ticket.preempted = True
        if self.executor.stop(ticket):
            if not self.executor.holds_sessions_of(ticket):  # there a cancel could only wait longer (Executor.run)
                asyncio.get_running_loop().call_later(STOP_GRACE, lambda run=job.run: run.done() or run.cancel())
        else:
            job.run.cancel()

    # --- the owner comes first (gpunet.worker.availability decides; the worker's server calls these) -------------

    def pause(self, reason: str, grace: float) -> None:
        """The owner wants the machine: take nothing new, send back the jobs waiting, stop those still running after
        ``grace`` seconds (their clients run them elsewhere; nothing is billed for them)."""
        starting = self.admission.paused is None
        self.admission.paused = reason
        for turn in self._turns.values():
            if not turn.done():
                turn.set_exception(self.admission.pause_error())
        if starting:
            self._pause_timer = asyncio.get_running_loop().call_later(grace, self._stop_all_for_pause)

    def resume(self) -> None:
        self.admission.paused = None
        if self._pause_timer is not None:
            self._pause_timer.cancel()
            self._pause_timer = None

    def stop_running(self) -> int:
        """The worker is leaving and its drain ran out of time: stop the jobs still running, as a pause does, before
        the executors go (killed under them, a job would read as its own crash). Their clients hear that the worker
        left and run them elsewhere; nothing is billed for them. Returns how many were running."""
        self._leaving = True
        for turn in list(self._turns.values()):  # first the waiting ones: a stopped job's slot must start nothing
            if not turn.done():
                turn.set_exception(self._leaving_error())
        running = list(self.lanes.running)
        for ticket in running:
            self._stop_run(ticket)
        return len(running)

    def _leaving_error(self) -> WorkerDraining:
        return WorkerDraining("this worker left the network before the job finished; run it elsewhere",
                              self.admission.queue_length)

    def _stop_all_for_pause(self) -> None:
        self._pause_timer = None
        running = list(self.lanes.running)
        if running:
            logger.info("Stopping %d job(s) still running after the pause's grace; their clients run them elsewhere",
                        len(running))
        for ticket in running:
            self._stop_run(ticket)

    def _check_deadline(self, submit: Submit) -> None:
        """Refuse at once a job that could not start here before its deadline (not left to time out in the queue)."""
        left = submit.deadline - time.time()
        wait = self.lanes.wait_estimate(submit.lane)
        if left <= 0 or wait >= left:
            raise DeadlineUnreachable(f"this worker cannot start the job before its deadline: about "
                                      f"{human_seconds(wait)} of work is ahead of it here, and the deadline is "
                                      f"{human_seconds(left)} away")

    async def _reply(self, outcome: Outcome, writer, client_id: str, host: str) -> None:
        """The result, within the time its size allows: a client that stops reading does not pin it here for long,
        and while it is written its bytes count against its client's share of the payload buffer (Admission.hold):
        one that does not read its results has its next payloads refused, not this process's memory filled."""
        size = len(outcome.outputs)
        inline = size <= INLINE_BYTES
        held = self._writing.get(id(outcome))  # a retry's stream writes the same bytes: held once
        if held is None:
            self.admission.hold(size, client_id, host)
            held = self._writing[id(outcome)] = [0, client_id, host]
        held[0] += 1
        try:
            async with asyncio.timeout(protocol.payload_deadline(size)):
                await protocol.write(writer, Result(size, _receipt_bytes(outcome),
                                                    outcome.outputs if inline else None, outcome.input_hash))
                if not inline:
                    await protocol.write_payload(writer, outcome.outputs)
        except (TimeoutError, ProtocolError) as e:
            if outcome.receipt is not None:  # it may have got the receipt, and countersign it later
                self.settlement.expect(client_id, outcome.receipt)
            if isinstance(e, TimeoutError):
                raise ProtocolError("the client stopped reading the result") from None
            raise
        finally:
            held[0] -= 1
            if not held[0]:
                del self._writing[id(outcome)]
                self.admission.release_bytes(size, held[1], held[2])
        metrics.BYTES_OUT.inc(size)


def _as_next_input(outputs: bytes) -> bytes | None:
    """A span's step output as the next span's step input: its one tensor, ``output_0``, renamed ``input_0``, so the
    bytes are those the client would send and both sides hash the same. None if the output is not one tensor, or is
    bigger than a push may be."""
    if len(outputs) > protocol.MAX_PUSH_BYTES + 1024:
        return None
    data = tensorframe.renamed(outputs, "output_0", "input_0")
    return data if data is not None and len(data) <= protocol.MAX_PUSH_BYTES else None


def _receipt_bytes(outcome: Outcome) -> bytes:
    """A result's receipt as sent; empty for a session step its session's tab bills later."""
    return outcome.receipt.to_bytes() if outcome.receipt is not None else b""


async def _try_send(writer, message: Error, reader=None) -> None:
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


def _release(buffer: bytearray) -> None:
    try:
        buffer.clear()
    except BufferError:  # still viewed somewhere (never by us once the job is over): it goes with its last view
        pass


class _NeedsStream(Exception):
    """The unary door cannot take this job (program or inputs must be sent): the client switches to the stream."""


class _StreamPayloads:
    """Asks the client for what the worker lacks (program, inputs) and reads it, capped, from the stream. A program
    may come from peers instead (``fetcher``): the client then sends who holds it and each piece's digest."""

    def __init__(self, reader, writer, limits: ServiceLimits, spool_dir: str | None = None,
                 fetcher: "Fetcher | None" = None):
        self.reader, self.writer, self.limits, self.spool_dir = reader, writer, limits, spool_dir
        self.fetcher = fetcher

    def precheck(self, submit: Submit, need_program: bool) -> None:
        pass  # the stream can carry anything

    async def fetch(self, submit: Submit, need_program: bool, charge: Callable[[int], None]) -> _Inputs:
        need_inputs = submit.inputs is None
        if not (need_program or need_inputs):
            return _Inputs(None, submit.inputs, sha256_hex(submit.inputs))
        from_peers = need_program and self.fetcher is not None and not submit.private
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
        program = None
        if need_program and pieces is None:
            program = await self._read_program(program_size)
        inputs = await self._read_inputs(submit) if need_inputs else None
        if pieces is not None:
            program = await self._from_peers(submit, pieces, charge)
        if not need_inputs:
            return _Inputs(program, submit.inputs, sha256_hex(submit.inputs))
        inputs.program = program
        return inputs

    async def _from_peers(self, submit: Submit, pieces: Pieces, charge: Callable[[int], None]) -> bytes | bytearray:
        """The program from the peers the client named (every piece checked; the executor checks the whole against
        its hash as it loads it, as for any program), else from the client after all. ``charge``: the budget, charged
        the program's size once, when its bytes start to come (from a peer, or from the client)."""
        charged = False

        def first_piece() -> None:
            nonlocal charged
            charge(pieces.size)
            charged = True

        # At most half the job's time (the client then still has the rest to send it), and no longer than the client
        # stays: it sends nothing until our answer, so any byte or EOF from it means it hung up.
        fetch = asyncio.ensure_future(self.fetcher.fetch(submit.program, pieces.piece_list(), pieces.holders,
                                                         submit.timeout / 2, coming=pieces.coming,
                                                         on_first=first_piece))
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
            raise ProtocolError("the client hung up while the program was being fetched from peers")
        fetched = fetch.result()
        if fetched is not None:
            return fetched  # a bytearray, not copied: the executor takes any bytes-like program
        if not charged:
            charge(pieces.size)  # WorkerBusy if there is no room for it now: the client hears so
        await protocol.write(self.writer, Send(True, False))
        payload = await protocol.read(self.reader, Payload, timeout=FRAME_TIMEOUT)
        if payload.program_size != pieces.size or payload.inputs_size is not None:
            raise ProtocolError("the program sent differs in size from the one the piece list describes")
        return await self._read_program(payload.program_size)

    async def _read_program(self, size: int) -> bytes:
        return bytes(await protocol.read_payload(self.reader, size, self.limits.max_program_bytes, "program",
                                                 timeout=protocol.payload_deadline(size if size is not None else 0)))

    async def _read_inputs(self, submit: Submit) -> _Inputs:
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
            return _Inputs(None, spooled, hasher.hexdigest())
        inputs = await protocol.read_payload(self.reader, submit.inputs_size, self.limits.max_input_bytes, "inputs",
                                             hasher, timeout=deadline)
        return _Inputs(None, inputs, hasher.hexdigest())  # a bytearray: no second copy of a large input


class _UnaryPayloads:
    """The unary door has only what came inline: anything missing sends the client to the stream door."""

    def precheck(self, submit: Submit, need_program: bool) -> None:
        if need_program or submit.inputs is None:
            raise _NeedsStream()

    async def fetch(self, submit: Submit, need_program: bool, charge: Callable[[int], None]) -> _Inputs:
        return _Inputs(None, submit.inputs, sha256_hex(submit.inputs))
