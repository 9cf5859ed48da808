"""The worker's RPC service: answers job and info streams over libp2p (hivemind's binary stream handlers).

A job stream, as the worker sees it (frames and payloads as in :mod:`gpunet.wire`)::

    <- submit {job, program, inputs_size, [inputs], timeout, max_price}
    -> error {code: busy | draining | ...}            (at once: admission control, before any payload moves)
    -> send {program: bool, inputs: bool}             (only when it lacks the program or the inputs were not inline)
    <- payload {program_size, inputs_size} + raw program + raw inputs
    -> result {outputs_size, [outputs], receipt} + raw outputs     | error {code, message}
    <- countersign {signature}                        (or nothing: the work stays visible as unpaid)

Job ids are per client: the same (client, job id) is never run twice; a repeat waits for, or gets, the first run's
result and the same receipt, so a retry is never billed twice. Every size is checked before it is read.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from gpunet.errors import (
    GpunetError,
    JobFailed,
    JobRejected,
    ProgramNotCached,
    ProtocolError,
    WorkerBusy,
)
from gpunet.identity import Identity
from gpunet.ledger.receipts import Receipt, attach_countersignature, sign_as_worker
from gpunet.ledger.store import Ledger
from gpunet.ledger.writer import FLUSH_DELAY, LedgerWriter, prewarm_signatures
from gpunet.wire import (
    FRAME_TIMEOUT,
    INLINE_BYTES,
    MAX_PING_BYTES,
    UNARY_OUTPUT_BYTES,
    cancel_protocol,
    error_frame,
    field,
    info_protocol,
    job_protocol,
    pack,
    payload_deadline,
    ping_protocol,
    read_frame,
    read_payload,
    run_protocol,
    settle_protocol,
    unpack,
    write_frame,
    write_payload,
)
from gpunet.worker import metrics
from gpunet.worker.cache import PROGRAM_HASH_RE

logger = logging.getLogger("gpunet.worker")

_JOB_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
COUNTERSIGN_TIMEOUT = 30.0
MAX_UNSETTLED = 4096
MAX_RECENT_RESULTS = 4096
MAX_TRACKED_CLIENTS = 10_000


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ServiceLimits:
    max_program_bytes: int = 2 * 1024**3
    max_input_bytes: int = 1024**3
    max_timeout: float = 3600.0
    recent_results_bytes: int = 256 * 1024**2  # finished results kept for retries of the same job id
    # Stopping a running job costs this worker a fresh executor (a torch import, the program cache): a client that
    # stops more than this many within the window gets its new jobs refused until older stops age out.
    max_stopped_jobs: int = 20
    stopped_jobs_window: float = 600.0


@dataclass
class _Outcome:
    outputs: bytes
    receipt: Receipt


class JobService:
    """Admission control, de-duplication, execution through the executor pool, and receipts."""

    def __init__(
        self,
        *,
        identity: Identity,
        network: str,
        executor,
        ledger: Ledger,
        price_micro: int,
        max_concurrent: int,
        max_queue: int,
        record: Callable[[], Any],
        limits: ServiceLimits = ServiceLimits(),
        corrupt_outputs: Callable[[bytes], bytes] | None = None,
    ):
        self.identity = identity
        self.network = network
        self.executor = executor
        self.ledger = ledger
        self.books = LedgerWriter(ledger)  # receipts are filed in batches, after the reply has gone
        self.price_micro = price_micro
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.limits = limits
        self._record = record
        self._corrupt_outputs = corrupt_outputs
        self.accepting = True
        self.admitted = 0  # jobs holding a place: queued or running
        self.running = 0
        self.settling = 0  # results delivered on a stream, countersignature not yet read
        # Results delivered by the unary door whose countersignature has not come yet (bounded: a client that never
        # countersigns cannot grow it; its work stays in the ledger's unpaid list either way).
        self.unsettled: OrderedDict[tuple[str, str], Receipt] = OrderedDict()
        self.jobs_done = 0
        self._slots = asyncio.Semaphore(max_concurrent)
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        self._running: dict[tuple[str, str], asyncio.Task] = {}  # admitted jobs, queued or running: cancellable
        self._stopped: OrderedDict[str, deque[float]] = OrderedDict()  # per client: when it stopped running jobs
        self._recent: OrderedDict[tuple[str, str], _Outcome] = OrderedDict()
        self._recent_bytes = 0
        self._p2p = None
        self._to_settle: list[tuple[str, list]] = []  # ride-along countersignatures, checked after the reply
        self._settle_timer: asyncio.TimerHandle | None = None
        self._filing: set[asyncio.Task] = set()

    @property
    def queue_length(self) -> int:
        return self.admitted - self.running

    @property
    def active(self) -> int:
        """Jobs not finished with: queued, running, or waiting for their countersignature. Draining waits for 0."""
        return self.admitted + self.settling

    async def start(self, p2p) -> None:
        self._p2p = p2p
        await p2p.add_binary_stream_handler(job_protocol(self.network), self._handle_job)
        await p2p.add_binary_stream_handler(info_protocol(self.network), self._handle_info)
        await p2p._client.add_unary_handler(ping_protocol(self.network), self._handle_ping)
        await p2p._client.add_unary_handler(run_protocol(self.network), self._handle_run)
        await p2p._client.add_unary_handler(settle_protocol(self.network), self._handle_settle)
        await p2p._client.add_unary_handler(cancel_protocol(self.network), self._handle_cancel)

    async def stop(self) -> None:
        self.accepting = False
        if self._p2p is not None:
            for proto in (job_protocol(self.network), info_protocol(self.network)):
                try:
                    await self._p2p.remove_binary_stream_handler(proto)
                except Exception:  # the daemon may already be gone at shutdown
                    pass
            for proto in (ping_protocol(self.network), run_protocol(self.network), settle_protocol(self.network),
                          cancel_protocol(self.network)):
                try:
                    await self._p2p._client.remove_unary_handler(proto)
                except Exception:
                    pass
            await self._p2p.shutdown()  # our replica's connections to the daemon, not the daemon itself
        if self._filing:  # countersignatures being checked in a thread: let them land
            await asyncio.wait(set(self._filing), timeout=10)
        self.file_settlements()

    def _file_soon(self) -> None:
        self._settle_timer = None
        batches, self._to_settle = self._to_settle, []
        task = asyncio.get_running_loop().create_task(self._check_then_file(batches))
        self._filing.add(task)
        task.add_done_callback(self._filing.discard)

    async def _check_then_file(self, batches: list[tuple[str, list]]) -> None:
        """Check countersignatures in a thread first (off the loop that serves jobs), then file them durably."""
        complete = []
        for client_id, items in batches:
            for item in items if isinstance(items, list) else ():
                receipt = self.unsettled.get((client_id, item[0])) if _settle_item_ok(item) else None
                if receipt is not None:
                    try:
                        complete.append(receipt._with_signature("client_signature", item[1]))
                    except GpunetError:
                        pass  # malformed: refused with its reason when filed
        await prewarm_signatures(complete)
        self._file(batches)

    def file_settlements(self) -> None:
        """Check and file every countersignature received so far, and write all queued receipts."""
        if self._settle_timer is not None:
            self._settle_timer.cancel()
            self._settle_timer = None
        batches, self._to_settle = self._to_settle, []
        self._file(batches)

    def _file(self, batches: list[tuple[str, list]]) -> None:
        for client_id, items in batches:
            self._settle_batch(client_id, items)
        self.books.flush()

    # --- ping and info ------------------------------------------------------------------------------------------------------

    async def _handle_ping(self, request: bytes, remote_id) -> bytes:
        return msgpack.packb({"time": time.time(), "echo": request[:MAX_PING_BYTES]}, use_bin_type=True)

    async def _handle_info(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _within(FRAME_TIMEOUT, read_frame(reader, "info"))
            await write_frame(writer, {"t": "info", "time": time.time(), "record": self._record().to_wire()})
        except GpunetError as e:
            logger.debug("info request from %s failed: %s", info.peer_id, e)
        finally:
            writer.close()

    # --- jobs: the stream door (any size) -------------------------------------------------------------------------

    async def _handle_job(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client_id = info.peer_id.to_base58()
        try:
            request = _Submit.parse(await _within(FRAME_TIMEOUT, read_frame(reader, "submit")), self.limits)
            outcome = await self._execute(client_id, request, _StreamPayloads(reader, writer, self.limits), reader)
            if outcome is None:
                await write_frame(writer, self._busy_frame())
                return
            await self._reply(outcome, writer)
            self.settling += 1
            try:
                await self._settle_from_stream(client_id, outcome.receipt, reader)
            finally:
                self.settling -= 1
        except ProtocolError as e:
            metrics.JOBS.labels("protocol_error").inc()
            logger.info("Dropped a malformed request from %s: %s", client_id[-8:], e)
            await _try_send(writer, error_frame(e))
        except ProgramNotCached as e:
            await _try_send(writer, error_frame(e, program=e.program_hash))
        except GpunetError as e:  # refused, failed or timed out: the client gets the reason
            await _try_send(writer, error_frame(e, queue=self.queue_length))
        except Exception as e:  # never let one stream take the worker down
            logger.exception("Unexpected error while serving %s", client_id[-8:])
            await _try_send(writer, error_frame(JobFailed(f"worker error: {type(e).__name__}")))
        finally:
            writer.close()

    # --- jobs: the unary door (small jobs whose program the worker holds: one round trip) ----------------------------

    async def _handle_run(self, request: bytes, remote_id) -> bytes:
        client_id = remote_id.to_base58()
        try:
            frame = unpack(request, "submit")
            submit = _Submit.parse(frame, self.limits)
            if frame.get("settle") is not None:  # countersignatures riding along: checked and filed after the reply
                self._to_settle.append((client_id, frame["settle"]))
                if self._settle_timer is None:
                    self._settle_timer = asyncio.get_running_loop().call_later(FLUSH_DELAY, self._file_soon)
            outcome = await self._execute(client_id, submit, _UnaryPayloads(), None)
            if outcome is None:
                return pack(self._busy_frame())
            if len(outcome.outputs) > UNARY_OUTPUT_BYTES:
                return pack({"t": "use_stream"})  # the result waits in the recent results for the stream retry
            if self.books.get(submit.job_id) is None:
                self.unsettled[(client_id, submit.job_id)] = outcome.receipt  # countersigned by a later call
                while len(self.unsettled) > MAX_UNSETTLED:
                    self.unsettled.popitem(last=False)
            return pack({"t": "result", "outputs_size": len(outcome.outputs), "outputs": outcome.outputs,
                          "receipt": outcome.receipt.to_bytes()})
        except (_NeedsStream, ProgramNotCached):  # the stream door can resend the program
            return pack({"t": "use_stream"})
        except GpunetError as e:
            return pack(error_frame(e, queue=self.queue_length))
        except Exception as e:
            logger.exception("Unexpected error while serving %s", client_id[-8:])
            return pack(error_frame(JobFailed(f"worker error: {type(e).__name__}")))

    def _busy_frame(self) -> dict:
        return error_frame(WorkerBusy("worker queue is full", self.queue_length), queue=self.queue_length)

    async def _handle_settle(self, request: bytes, remote_id) -> bytes:
        try:
            frame = unpack(request, ("countersign", "refuse", "countersign_batch"))
            if frame["t"] == "countersign_batch":
                await self._check_then_file([(remote_id.to_base58(), frame.get("items"))])
            else:
                self._settle(remote_id.to_base58(), field(frame, "job", str), frame)
            self.books.flush()
            return pack({"t": "ok"})
        except GpunetError as e:
            return pack(error_frame(e))

    async def _handle_cancel(self, request: bytes, remote_id) -> bytes:
        """A client stops one of its own jobs (queued or running; the executor running it is replaced)."""
        try:
            job_id = field(unpack(request, "cancel"), "job", str)
            task = self._running.get((remote_id.to_base58(), job_id))
            if task is not None:
                task.cancel()
            return pack({"t": "ok", "cancelled": task is not None})
        except GpunetError as e:
            return pack(error_frame(e))

    def _settle_batch(self, client_id: str, items) -> None:
        """Countersignatures ``[[job_id, signature], ...]``; a bad one is logged and skipped, never fatal."""
        if items is None:
            return
        if not isinstance(items, list) or len(items) > 1024:
            logger.warning("Ignored a malformed settle list from %s (the job itself is served)", client_id[-8:])
            return
        for item in items:
            try:
                if not _settle_item_ok(item):
                    raise ProtocolError("a settle item must be [job id, signature]")
                self._settle(client_id, item[0], {"t": "countersign", "signature": item[1]})
            except GpunetError as e:
                logger.warning("Bad countersignature from %s: %s", client_id[-8:], e)

    # --- jobs: what both doors share -------------------------------------------------------------------------------

    async def _execute(self, client_id: str, req: "_Submit", payloads, reader) -> "_Outcome | None":
        """Admit, de-duplicate and run one job; None when the worker is busy (the caller answers busy)."""
        if req.max_price is not None and req.max_price < self.price_micro:
            raise JobRejected(f"this worker's price {self.price_micro} micro-credits/PFLOP is above the job's bound "
                              f"{req.max_price}")
        stopped = self._recent_stops(client_id)
        if stopped >= self.limits.max_stopped_jobs:
            raise JobRejected(f"this client stopped {stopped} running jobs here in the last "
                              f"{self.limits.stopped_jobs_window / 60:.0f} min (each costs this worker a fresh "
                              "executor); it takes no more of its jobs for now")
        key = (client_id, req.job_id)
        paid = self.books.get(req.job_id)
        if paid is not None and paid.client_id != client_id:
            raise JobRejected(f"job id {req.job_id[:16]} was already used by another client; use a fresh one")
        if key in self._recent:  # a retry of a finished job: same result, same receipt, no second bill
            self._recent.move_to_end(key)
            return self._recent[key]
        if key in self._inflight:  # a retry while the first run is still going: wait for it
            return await asyncio.shield(self._inflight[key])
        if not self.accepting:
            raise WorkerBusy("worker is draining: it finishes running jobs and takes no new ones", self.queue_length)
        if self.admitted >= self.max_concurrent + self.max_queue:
            metrics.JOBS.labels("busy").inc()
            return None
        need_program = not self.executor.has_program(req.program_hash)
        payloads.precheck(req, need_program)
        self.admitted += 1
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            program_bytes, inputs, input_hash = await payloads.fetch(req, need_program)
            metrics.BYTES_IN.inc(len(inputs) + len(program_bytes or b""))
            outcome = await self._run(key, req.program_hash, program_bytes, inputs, input_hash, req.timeout,
                                      req.max_price, reader)
            future.set_result(outcome)
        except BaseException as e:
            future.set_exception(e if isinstance(e, GpunetError) else JobFailed(f"job did not finish: {type(e).__name__}"))
            future.exception()  # retrieved: a waiting retry gets it, an unwatched one does not warn
            raise
        finally:
            self._inflight.pop(key, None)
            self.admitted -= 1
        self._remember(key, outcome)
        return outcome

    async def _run(
        self, key: tuple[str, str], program_hash, program_bytes, inputs: bytes, input_hash: str, timeout, max_price,
        reader,
    ) -> _Outcome:
        """Run a job, stoppable while queued or running: by a cancel call from its client, or (stream door) by the
        client hanging up. Either way the executor running it is replaced, so abandoned work stops using the machine.
        """
        client_id, job_id = key
        running = asyncio.ensure_future(
            self._run_now(client_id, job_id, program_hash, program_bytes, inputs, input_hash, timeout, max_price))
        self._running[key] = running
        # The client sends nothing between its payload and our result, so any byte or EOF here means it is gone.
        gone = asyncio.ensure_future(reader.read(1)) if reader is not None else None
        try:
            await asyncio.wait({running, gone} if gone else {running}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._running.pop(key, None)
            if gone is not None:
                gone.cancel()
            if not running.done():
                running.cancel()
                await asyncio.wait({running})  # let it give back its slot and executor before we answer
        if running.cancelled():
            raise JobFailed("job stopped before it finished: its client cancelled it or went away")
        return running.result()

    async def _run_now(
        self, client_id, job_id, program_hash, program_bytes, inputs: bytes, input_hash: str, timeout, max_price
    ) -> _Outcome:
        await self._slots.acquire()
        self.running += 1
        started = time.time()
        logger.debug("Running job %s for client %s", job_id[:12], client_id[-8:])
        try:
            with metrics.JOB_SECONDS.time():
                # ProgramNotCached (evicted since admission) reaches the client as "not_cached": it resends the program.
                result = await self.executor.run(program_hash, program_bytes, inputs, timeout=timeout)
        except GpunetError as e:
            metrics.JOBS.labels(type(e).__name__).inc()
            raise
        except asyncio.CancelledError:
            metrics.JOBS.labels("cancelled").inc()
            self._note_stop(client_id)
            logger.info("Job %s for client %s stopped while running (cancelled, or the client went away); its "
                        "executor was replaced", job_id[:12], client_id[-8:])
            raise
        finally:
            self.running -= 1
            self._slots.release()
        ended = time.time()
        outputs = result.outputs if self._corrupt_outputs is None else self._corrupt_outputs(result.outputs)
        receipt = sign_as_worker(
            self.identity,
            job_id=job_id,
            client_id=client_id,
            program_hash=program_hash,
            input_hash=input_hash,
            output_hash=sha256_hex(outputs),
            flops=int(result.flops),
            wall_time_us=int(result.wall_time * 1e6),
            price=self.price_micro,
            max_price=max_price,
            started_at_us=int(started * 1e6),
            ended_at_us=int(ended * 1e6),
        )
        self.books.record_unpaid(receipt)  # until the countersignature arrives, this is work the client owes
        self.jobs_done += 1
        metrics.JOBS.labels("done").inc()
        logger.debug("Job %s for client %s done in %.2f s (%.3g GFLOP)", job_id[:12], client_id[-8:],
                     ended - started, result.flops / 1e9)
        return _Outcome(outputs, receipt)

    def _note_stop(self, client_id: str) -> None:
        self._stopped.setdefault(client_id, deque()).append(time.monotonic())
        self._stopped.move_to_end(client_id)
        while len(self._stopped) > MAX_TRACKED_CLIENTS:  # bounded: the least recently seen client is forgotten
            self._stopped.popitem(last=False)

    def _recent_stops(self, client_id: str) -> int:
        stops = self._stopped.get(client_id)
        if not stops:
            return 0
        horizon = time.monotonic() - self.limits.stopped_jobs_window
        while stops and stops[0] < horizon:
            stops.popleft()
        return len(stops)

    def _remember(self, key, outcome: _Outcome) -> None:
        """Keep a finished result for retries of the same job id, bounded by bytes and by count (the newest stays)."""
        self._recent[key] = outcome
        self._recent_bytes += len(outcome.outputs)
        while len(self._recent) > 1 and (self._recent_bytes > self.limits.recent_results_bytes
                                         or len(self._recent) > MAX_RECENT_RESULTS):
            _, old = self._recent.popitem(last=False)
            self._recent_bytes -= len(old.outputs)

    async def _reply(self, outcome: _Outcome, writer) -> None:
        inline = len(outcome.outputs) <= INLINE_BYTES
        frame = {"t": "result", "outputs_size": len(outcome.outputs), "receipt": outcome.receipt.to_bytes()}
        if inline:
            frame["outputs"] = outcome.outputs
        await write_frame(writer, frame)
        if not inline:
            await write_payload(writer, outcome.outputs)
        metrics.BYTES_OUT.inc(len(outcome.outputs))

    async def _settle_from_stream(self, client_id: str, receipt: Receipt, reader) -> None:
        """Wait briefly for the countersignature on the stream; without it the receipt stays in the unpaid list."""
        try:
            frame = await asyncio.wait_for(read_frame(reader, ("countersign", "refuse")), COUNTERSIGN_TIMEOUT)
        except (asyncio.TimeoutError, ProtocolError):
            logger.warning("Client %s did not countersign job %s: recorded as unpaid", client_id[-8:], receipt.job_id[:12])
            return
        try:
            self._settle(client_id, receipt.job_id, frame, receipt)
            self.books.flush()  # off the job's path already (the result has gone): make the payment durable now
        except GpunetError as e:
            logger.warning("Bad settlement from %s for job %s: %s", client_id[-8:], receipt.job_id[:12], e)

    def _settle(self, client_id: str, job_id: str, frame: dict, receipt: Receipt | None = None) -> None:
        """A client's countersignature (or refusal) for a job it received from us."""
        key = (client_id, job_id)
        if receipt is None:
            receipt = self.unsettled.get(key) or (self._recent[key].receipt if key in self._recent else None)
        if receipt is None:
            raise JobRejected(f"no result of job {job_id[:16]} for this client awaits settlement")
        if frame["t"] == "refuse":
            self.unsettled.pop((client_id, job_id), None)
            logger.warning("Client %s refused the receipt for job %s: %s", client_id[-8:], job_id[:12],
                           str(frame.get("reason"))[:200])
            return
        complete = attach_countersignature(receipt, field(frame, "signature", bytes))  # InvalidReceipt if forged
        if self.books.get(job_id) is None:
            self.books.append(complete)
        self.unsettled.pop((client_id, job_id), None)


def _settle_item_ok(item) -> bool:
    return isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], bytes)


async def _within(seconds: float, awaitable):
    """A read from a peer, bounded in time: a stalled peer gets a ProtocolError, not a slot held forever."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        raise ProtocolError(f"peer sent nothing for {seconds:.0f} s") from None


async def _try_send(writer, frame: dict) -> None:
    try:
        await write_frame(writer, frame)
    except Exception:
        pass


class _NeedsStream(Exception):
    """The unary door cannot take this job (program or inputs must be sent): the client switches to the stream."""


@dataclass(frozen=True)
class _Submit:
    """A submit message, checked field by field."""

    job_id: str
    program_hash: str
    inputs_size: int
    inline_inputs: bytes | None
    timeout: float
    max_price: int | None

    @classmethod
    def parse(cls, frame: dict, limits: ServiceLimits) -> "_Submit":
        job_id = field(frame, "job", str)
        program_hash = field(frame, "program", str)
        if not _JOB_ID.match(job_id):
            raise ProtocolError("job id must be 1-64 characters of [A-Za-z0-9_.:-]")
        if not PROGRAM_HASH_RE.match(program_hash):
            raise ProtocolError("program hash must be 64 lowercase hex characters")
        inputs_size = field(frame, "inputs_size", int)
        inline = field(frame, "inputs", bytes, optional=True)
        timeout = float(field(frame, "timeout", (int, float), optional=True) or 60.0)
        max_price = field(frame, "max_price", int, optional=True)
        if not 0 < timeout <= limits.max_timeout:
            raise ProtocolError(f"timeout must be in (0, {limits.max_timeout:g}] seconds")
        if inputs_size > limits.max_input_bytes:
            raise JobRejected(f"inputs of {inputs_size} bytes exceed this worker's limit of {limits.max_input_bytes}")
        if inline is not None and len(inline) != inputs_size:
            raise ProtocolError("inline inputs do not match the declared inputs size")
        return cls(job_id, program_hash, inputs_size, inline, timeout, max_price)


class _StreamPayloads:
    """Asks the client for what the worker lacks (program, inputs) and reads it, capped, from the stream."""

    def __init__(self, reader, writer, limits: ServiceLimits):
        self.reader, self.writer, self.limits = reader, writer, limits

    def precheck(self, req: _Submit, need_program: bool) -> None:
        pass  # the stream can carry anything

    async def fetch(self, req: _Submit, need_program: bool) -> tuple[bytes | None, bytes, str]:
        need_inputs = req.inline_inputs is None
        if not (need_program or need_inputs):
            return None, req.inline_inputs, sha256_hex(req.inline_inputs)
        await write_frame(self.writer, {"t": "send", "program": need_program, "inputs": need_inputs})
        payload = await _within(FRAME_TIMEOUT, read_frame(self.reader, "payload"))
        if need_inputs and payload.get("inputs_size") != req.inputs_size:
            raise ProtocolError("inputs payload size differs from the size the submit declared")
        program = None
        if need_program:
            size = payload.get("program_size")
            program = bytes(await _within(payload_deadline(size if type(size) is int else 0), read_payload(
                self.reader, size, self.limits.max_program_bytes, "program")))
        if not need_inputs:
            return program, req.inline_inputs, sha256_hex(req.inline_inputs)
        hasher = hashlib.sha256()
        inputs = await _within(payload_deadline(req.inputs_size), read_payload(
            self.reader, req.inputs_size, self.limits.max_input_bytes, "inputs", hasher))
        return program, inputs, hasher.hexdigest()  # a bytearray: no second copy of a large input


class _UnaryPayloads:
    """The unary door has only what came inline: anything missing sends the client to the stream door."""

    def precheck(self, req: _Submit, need_program: bool) -> None:
        if need_program or req.inline_inputs is None:
            raise _NeedsStream()

    async def fetch(self, req: _Submit, need_program: bool) -> tuple[bytes | None, bytes, str]:
        return None, req.inline_inputs, sha256_hex(req.inline_inputs)
