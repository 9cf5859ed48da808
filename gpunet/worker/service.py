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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from gpunet.errors import GpunetError, JobFailed, JobRejected, ProgramNotCached, ProtocolError, WorkerBusy
from gpunet.ledger.identity import Identity
from gpunet.ledger.receipts import Receipt, attach_countersignature, sign_as_worker
from gpunet.ledger.store import Ledger
from gpunet.worker import metrics
from gpunet.wire import (
    MAX_PING_BYTES, error_frame, field, info_protocol, job_protocol, ping_protocol, read_frame, read_payload,
    write_frame, write_payload,
)

logger = logging.getLogger("gpunet.worker")

#: Payloads at most this big ride inside the control frame, saving a round trip for small jobs.
INLINE_BYTES = 32 * 1024
_JOB_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")
COUNTERSIGN_TIMEOUT = 30.0


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ServiceLimits:
    max_program_bytes: int = 2 * 1024**3
    max_input_bytes: int = 1024**3
    max_timeout: float = 3600.0
    recent_results_bytes: int = 256 * 1024**2  # finished results kept for retries of the same job id


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
        self.price_micro = price_micro
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.limits = limits
        self._record = record
        self._corrupt_outputs = corrupt_outputs
        self.accepting = True
        self.admitted = 0  # jobs holding a place: queued or running
        self.running = 0
        self.jobs_done = 0
        self._slots = asyncio.Semaphore(max_concurrent)
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        self._recent: OrderedDict[tuple[str, str], _Outcome] = OrderedDict()
        self._recent_bytes = 0
        self._p2p = None

    @property
    def queue_length(self) -> int:
        return self.admitted - self.running

    async def start(self, p2p) -> None:
        self._p2p = p2p
        await p2p.add_binary_stream_handler(job_protocol(self.network), self._handle_job)
        await p2p.add_binary_stream_handler(info_protocol(self.network), self._handle_info)
        await p2p._client.add_unary_handler(ping_protocol(self.network), self._handle_ping)

    async def stop(self) -> None:
        self.accepting = False
        if self._p2p is not None:
            for proto in (job_protocol(self.network), info_protocol(self.network)):
                try:
                    await self._p2p.remove_binary_stream_handler(proto)
                except Exception:  # the daemon may already be gone at shutdown
                    pass

    # --- ping and info ------------------------------------------------------------------------------------------------------

    async def _handle_ping(self, request: bytes, remote_id) -> bytes:
        return msgpack.packb({"time": time.time(), "echo": request[:MAX_PING_BYTES]}, use_bin_type=True)

    async def _handle_info(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_frame(reader, "info")
            await write_frame(writer, {"t": "info", "time": time.time(), "record": self._record().to_wire()})
        except GpunetError as e:
            logger.debug("info request from %s failed: %s", info.peer_id, e)
        finally:
            writer.close()

    # --- jobs ------------------------------------------------------------------------------------------------------

    async def _handle_job(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client_id = info.peer_id.to_base58()
        try:
            await self._serve_job(client_id, reader, writer)
        except ProtocolError as e:
            metrics.JOBS.labels("protocol_error").inc()
            logger.info("Dropped a malformed request from %s: %s", client_id[-8:], e)
            await _try_send(writer, error_frame(e))
        except GpunetError as e:  # refused, failed or timed out: the client gets the reason
            await _try_send(writer, error_frame(e, queue=self.queue_length))
        except Exception as e:  # never let one stream take the worker down
            logger.exception("Unexpected error while serving %s", client_id[-8:])
            await _try_send(writer, error_frame(JobFailed(f"worker error: {type(e).__name__}")))
        finally:
            writer.close()

    async def _serve_job(self, client_id: str, reader, writer) -> None:
        submit = await read_frame(reader, "submit")
        job_id = field(submit, "job", str)
        program_hash = field(submit, "program", str)
        if not _JOB_ID.match(job_id):
            raise ProtocolError("job id must be 1-64 characters of [A-Za-z0-9_.:-]")
        if not _HASH.match(program_hash):
            raise ProtocolError("program hash must be 64 lowercase hex characters")
        inputs_size = field(submit, "inputs_size", int)
        inline_inputs = field(submit, "inputs", bytes, optional=True)
        timeout = float(field(submit, "timeout", (int, float), optional=True) or 60.0)
        max_price = field(submit, "max_price", int, optional=True)
        if not 0 < timeout <= self.limits.max_timeout:
            raise ProtocolError(f"timeout must be in (0, {self.limits.max_timeout:g}] seconds")
        if inputs_size > self.limits.max_input_bytes:
            raise JobRejected(f"inputs of {inputs_size} bytes exceed this worker's limit of {self.limits.max_input_bytes}")
        if max_price is not None and max_price < self.price_micro:
            raise JobRejected(f"this worker's price {self.price_micro} micro-credits/PFLOP is above the job's bound {max_price}")

        key = (client_id, job_id)
        if key in self._recent:  # a retry of a finished job: same result, same receipt, no second bill
            self._recent.move_to_end(key)
            return await self._reply(key, self._recent[key], reader, writer)
        if key in self._inflight:  # a retry while the first run is still going: wait for it
            outcome = await asyncio.shield(self._inflight[key])
            return await self._reply(key, outcome, reader, writer)
        if not self.accepting:
            raise WorkerBusy("worker is draining: it finishes running jobs and takes no new ones", self.queue_length)
        if self.admitted >= self.max_concurrent + self.max_queue:
            metrics.JOBS.labels("busy").inc()
            await write_frame(writer, error_frame(WorkerBusy("worker queue is full", self.queue_length), queue=self.queue_length))
            return

        self.admitted += 1
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            need_program = not self.executor.has_program(program_hash)
            need_inputs = inline_inputs is None
            if inline_inputs is not None and len(inline_inputs) != inputs_size:
                raise ProtocolError("inline inputs do not match the declared inputs size")
            program_bytes = None
            inputs = inline_inputs
            if need_program or need_inputs:
                await write_frame(writer, {"t": "send", "program": need_program, "inputs": need_inputs})
                payload = await read_frame(reader, "payload")
                if need_program:
                    program_bytes = bytes(await read_payload(
                        reader, payload.get("program_size"), self.limits.max_program_bytes, "program"))
                    metrics.BYTES_IN.inc(len(program_bytes))
                if need_inputs:
                    inputs = await read_payload(reader, payload.get("inputs_size"), self.limits.max_input_bytes, "inputs")
                    if len(inputs) != inputs_size:
                        raise ProtocolError("inputs payload does not match the declared inputs size")
            metrics.BYTES_IN.inc(len(inputs))
            outcome = await self._run(client_id, job_id, program_hash, program_bytes, bytes(inputs), timeout, max_price, reader)
            future.set_result(outcome)
        except BaseException as e:
            future.set_exception(e if isinstance(e, GpunetError) else JobFailed(f"job did not finish: {type(e).__name__}"))
            future.exception()  # retrieved: a waiting retry gets it, an unwatched one does not warn
            raise
        finally:
            self._inflight.pop(key, None)
            self.admitted -= 1
        self._remember(key, future.result())
        await self._reply(key, future.result(), reader, writer)

    async def _run(
        self, client_id, job_id, program_hash, program_bytes, inputs: bytes, timeout, max_price, reader
    ) -> _Outcome:
        # While queued, a client that hangs up (cancel, crash) gives its place back.
        gone = asyncio.ensure_future(reader.read(1))
        acquire = asyncio.ensure_future(self._slots.acquire())
        await asyncio.wait({gone, acquire}, return_when=asyncio.FIRST_COMPLETED)
        if not acquire.done():
            acquire.cancel()
            metrics.JOBS.labels("cancelled").inc()
            raise JobFailed("client went away before the job started")
        gone.cancel()
        self.running += 1
        started = time.time()
        logger.info("Running job %s for client %s", job_id[:12], client_id[-8:])
        try:
            with metrics.JOB_SECONDS.time():
                try:
                    result = await self.executor.run(program_hash, program_bytes, inputs, timeout=timeout)
                except ProgramNotCached:
                    raise JobFailed("worker lost the program from its cache; retry sends it again") from None
        except GpunetError as e:
            metrics.JOBS.labels(type(e).__name__).inc()
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
            input_hash=sha256_hex(inputs),
            output_hash=sha256_hex(outputs),
            flops=int(result.flops),
            wall_time_us=int(result.wall_time * 1e6),
            price=self.price_micro,
            max_price=max_price,
            started_at_us=int(started * 1e6),
            ended_at_us=int(ended * 1e6),
        )
        self.ledger.record_unpaid(receipt)  # until the countersignature arrives, this is work the client owes
        self.jobs_done += 1
        metrics.JOBS.labels("done").inc()
        logger.info("Job %s for client %s done in %.2f s (%.3g GFLOP)", job_id[:12], client_id[-8:],
                    ended - started, result.flops / 1e9)
        return _Outcome(outputs, receipt)

    def _remember(self, key, outcome: _Outcome) -> None:
        self._recent[key] = outcome
        self._recent_bytes += len(outcome.outputs)
        while self._recent and self._recent_bytes > self.limits.recent_results_bytes:
            _, old = self._recent.popitem(last=False)
            self._recent_bytes -= len(old.outputs)

    async def _reply(self, key, outcome: _Outcome, reader, writer) -> None:
        inline = len(outcome.outputs) <= INLINE_BYTES
        frame = {"t": "result", "outputs_size": len(outcome.outputs), "receipt": outcome.receipt.to_bytes()}
        if inline:
            frame["outputs"] = outcome.outputs
        await write_frame(writer, frame)
        if not inline:
            await write_payload(writer, outcome.outputs)
        metrics.BYTES_OUT.inc(len(outcome.outputs))
        await self._settle(outcome.receipt, reader)

    async def _settle(self, receipt: Receipt, reader) -> None:
        """Wait briefly for the client's countersignature; without it the receipt stays in the unpaid list."""
        try:
            frame = await asyncio.wait_for(read_frame(reader, ("countersign", "refuse")), COUNTERSIGN_TIMEOUT)
        except (asyncio.TimeoutError, ProtocolError):
            logger.warning("Client %s did not countersign job %s: recorded as unpaid", receipt.client_id[-8:], receipt.job_id[:12])
            return
        if frame["t"] == "refuse":
            logger.warning("Client %s refused the receipt for job %s: %s", receipt.client_id[-8:], receipt.job_id[:12],
                           str(frame.get("reason"))[:200])
            return
        try:
            complete = attach_countersignature(receipt, field(frame, "signature", bytes))
        except GpunetError as e:
            logger.warning("Bad countersignature from %s for job %s: %s", receipt.client_id[-8:], receipt.job_id[:12], e)
            return
        if self.ledger.get(receipt.job_id) is None:
            self.ledger.append(complete)


async def _try_send(writer, frame: dict) -> None:
    try:
        await write_frame(writer, frame)
    except Exception:
        pass
