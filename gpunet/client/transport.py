"""The client's side of the job protocol (see :mod:`gpunet.worker.service` for the exchange): moves bytes, nothing else.

Routing decides who; this module opens the libp2p stream to that worker, sends the job, streams payloads, and returns
the worker's outputs and signed receipt, leaving the stream open for the countersignature.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from hivemind.p2p import PeerID

from gpunet.errors import NetworkError, ProtocolError
from gpunet.ledger.receipts import Receipt
from gpunet.wire import (
    INLINE_BYTES,
    cancel_protocol,
    error_from_frame,
    field,
    info_protocol,
    job_protocol,
    pack,
    ping_protocol,
    read_frame,
    read_payload,
    run_protocol,
    settle_protocol,
    unpack,
    write_frame,
    write_payload,
)

MAX_OUTPUT_BYTES = 4 * 1024**3


@functools.lru_cache(maxsize=4096)
def _peer(worker_id: str) -> PeerID:
    return PeerID.from_base58(worker_id)


@dataclass
class Delivery:
    """A worker's answer: outputs and receipt, with a way back to the worker to countersign or refuse."""

    worker_id: str  # the peer that answered, as the libp2p channel authenticated it
    outputs: bytes
    receipt: Receipt
    bytes_sent: int
    transfer_seconds: float
    _writer: asyncio.StreamWriter | None = None  # the stream door: answer on the same stream
    _settle: Callable[[dict], Awaitable[None]] | None = None  # the unary door: a settle call

    @property
    def via_unary(self) -> bool:
        return self._writer is None

    async def countersign(self, signature: bytes) -> None:
        await self._finish({"t": "countersign", "job": self.receipt.job_id, "signature": signature})

    async def refuse(self, reason: str) -> None:
        await self._finish({"t": "refuse", "job": self.receipt.job_id, "reason": reason[:500]})

    async def _finish(self, frame: dict) -> None:
        try:
            if self._writer is not None:
                await write_frame(self._writer, frame)
            elif self._settle is not None:
                await self._settle(frame)
        except Exception:
            pass  # the worker keeps it as unpaid; nothing more we can do
        finally:
            self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class UseStream(Exception):
    """The worker cannot take this job through the unary door (it lacks the program, or the outputs are large)."""


async def open_stream(p2p, worker_id: str, maddrs: list[str], protocol: str):
    """A stream to ``worker_id``; dials its advertised addresses if the daemon does not know the peer yet."""
    peer = PeerID.from_base58(worker_id)
    try:
        return await p2p.call_binary_stream_handler(peer, protocol)
    except Exception as first:
        if not maddrs:
            raise NetworkError(f"cannot reach worker {worker_id[-8:]}: {first}") from None
    try:
        from hivemind.utils.multiaddr import Multiaddr

        await p2p._client.connect(peer, [Multiaddr(m.split("/p2p/")[0]) for m in maddrs])
        return await p2p.call_binary_stream_handler(peer, protocol)
    except Exception as e:
        raise NetworkError(f"cannot reach worker {worker_id[-8:]}: {e}") from None


async def send_settlements(p2p, network: str, worker_id: str, items: list[tuple[str, bytes]]) -> None:
    """Countersignatures for results received through the unary door, in one call."""
    request = pack({"t": "countersign_batch", "items": [list(i) for i in items]})
    await p2p._client.call_unary_handler(_peer(worker_id), settle_protocol(network), request)


async def send_cancel(p2p, network: str, worker_id: str, job_id: str) -> bool:
    """Ask a worker to stop a job we submitted through the unary door; True if it was still queued or running."""
    reply = await p2p._client.call_unary_handler(_peer(worker_id), cancel_protocol(network),
                                                 pack({"t": "cancel", "job": job_id}))
    return bool(unpack(reply, "ok").get("cancelled"))


async def send_job_unary(
    p2p,
    network: str,
    worker_id: str,
    *,
    job_id: str,
    program_hash: str,
    inputs: bytes,
    timeout: float,
    max_price: int | None,
    settle: list[tuple[str, bytes]] = (),
) -> Delivery:
    """One round trip over the daemon's persistent connection, for a small job whose program the worker holds.

    ``settle`` carries countersignatures still owed to this worker, so steady traffic needs no separate settle calls.
    Raises UseStream when the worker wants the stream door instead, or the same errors as :func:`send_job`.
    """
    peer = _peer(worker_id)
    message = {"t": "submit", "job": job_id, "program": program_hash, "inputs_size": len(inputs), "inputs": inputs,
               "timeout": float(timeout), "max_price": max_price}
    if settle:
        message["settle"] = [list(i) for i in settle]
    try:
        reply = await p2p._client.call_unary_handler(peer, run_protocol(network), pack(message))
    except Exception as e:  # the daemon reports an unreachable peer or a dead handler as a generic error
        raise NetworkError(f"worker {worker_id[-8:]} did not answer: {e}") from None
    frame = unpack(reply, ("use_stream", "error", "result"))
    if frame["t"] == "use_stream":
        raise UseStream()
    if frame["t"] == "error":
        raise error_from_frame(frame)
    outputs = field(frame, "outputs", bytes)
    if len(outputs) != field(frame, "outputs_size", int):
        raise ProtocolError("outputs do not match their declared size")
    receipt = Receipt.from_bytes(field(frame, "receipt", bytes))

    async def settle(message: dict) -> None:
        await p2p._client.call_unary_handler(peer, settle_protocol(network), pack(message))

    return Delivery(worker_id, outputs, receipt, len(inputs), 0.0, _settle=settle)


async def send_job(
    p2p,
    network: str,
    worker_id: str,
    maddrs: list[str],
    *,
    job_id: str,
    program_hash: str,
    program_bytes: bytes,
    inputs: bytes,
    timeout: float,
    max_price: int | None,
    max_output_bytes: int = MAX_OUTPUT_BYTES,
) -> Delivery:
    """Run one job on one worker. Raises WorkerBusy, JobRejected, JobFailed, JobTimeout, ProtocolError, NetworkError.

    ``max_output_bytes``: the most the answer may declare (the client knows it from the dry run); more is refused
    before anything is read.
    """
    _, reader, writer = await open_stream(p2p, worker_id, maddrs, job_protocol(network))
    try:
        submit = {
            "t": "submit", "job": job_id, "program": program_hash, "inputs_size": len(inputs),
            "timeout": float(timeout), "max_price": max_price,
        }
        inline = len(inputs) <= INLINE_BYTES
        if inline:
            submit["inputs"] = inputs
        await write_frame(writer, submit)
        sent = len(inputs) if inline else 0
        frame = await read_frame(reader, ("send", "result", "error"))
        transfer_seconds = 0.0
        if frame["t"] == "send":
            want_program = field(frame, "program", bool)
            want_inputs = field(frame, "inputs", bool)
            t0 = time.perf_counter()
            await write_frame(writer, {
                "t": "payload",
                "program_size": len(program_bytes) if want_program else None,
                "inputs_size": len(inputs) if want_inputs else None,
            })
            if want_program:
                await write_payload(writer, program_bytes)
                sent += len(program_bytes)
            if want_inputs:
                await write_payload(writer, inputs)
                sent += len(inputs)
            transfer_seconds = time.perf_counter() - t0
            frame = await read_frame(reader, ("result", "error"))
        if frame["t"] == "error":
            raise error_from_frame(frame)
        size = field(frame, "outputs_size", int)
        outputs = frame.get("outputs")
        if outputs is None:
            t0 = time.perf_counter()
            outputs = bytes(await read_payload(reader, size, min(max_output_bytes, MAX_OUTPUT_BYTES), "outputs"))
            transfer_seconds += time.perf_counter() - t0
        elif not isinstance(outputs, bytes) or len(outputs) != size:
            raise ProtocolError("inline outputs do not match their declared size")
        receipt = Receipt.from_bytes(field(frame, "receipt", bytes))
        return Delivery(worker_id, outputs, receipt, sent, transfer_seconds, _writer=writer)
    except BaseException:
        writer.close()
        raise


async def ping(p2p, network: str, worker_id: str, payload: bytes = b"") -> dict:
    """One unary round trip to a worker: its clock and our payload echoed back."""
    import msgpack

    try:
        reply = await p2p._client.call_unary_handler(PeerID.from_base58(worker_id), ping_protocol(network), payload)
    except Exception as e:
        raise NetworkError(f"worker {worker_id[-8:]} did not answer a ping: {e}") from None
    try:
        return msgpack.unpackb(reply, raw=False)
    except Exception:
        raise ProtocolError("ping reply is not valid msgpack") from None


async def fetch_info(p2p, network: str, worker_id: str, maddrs: list[str]) -> dict:
    """A worker's live record and clock, straight from the worker (used by ``doctor`` and tests)."""
    _, reader, writer = await open_stream(p2p, worker_id, maddrs, info_protocol(network))
    try:
        t0 = time.time()
        await write_frame(writer, {"t": "info"})
        frame = await read_frame(reader, "info")
        frame["rtt"] = time.time() - t0
        frame["local_time"] = (t0 + time.time()) / 2
        return frame
    finally:
        writer.close()
