"""The client's side of the job protocol (see :mod:`gpunet.worker.service` for the exchange): moves bytes, nothing else.

Routing decides who; this module opens the libp2p stream to that worker, sends the job, streams payloads, and returns
the worker's outputs and signed receipt, leaving the stream open for the countersignature.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from hivemind.p2p import PeerID

from gpunet.errors import NetworkError, ProtocolError
from gpunet.ledger.receipts import Receipt
from gpunet.wire import (
    error_from_frame, field, info_protocol, job_protocol, ping_protocol, read_frame, read_payload, write_frame,
    write_payload,
)

INLINE_BYTES = 32 * 1024
MAX_OUTPUT_BYTES = 4 * 1024**3


@dataclass
class Delivery:
    """A worker's answer: outputs and receipt, with the stream still open to countersign or refuse."""

    outputs: bytes
    receipt: Receipt
    bytes_sent: int
    transfer_seconds: float
    _writer: asyncio.StreamWriter

    async def countersign(self, signature: bytes) -> None:
        await self._finish({"t": "countersign", "signature": signature})

    async def refuse(self, reason: str) -> None:
        await self._finish({"t": "refuse", "reason": reason[:500]})

    async def _finish(self, frame: dict) -> None:
        try:
            await write_frame(self._writer, frame)
        except (ConnectionError, OSError):
            pass  # the worker keeps it as unpaid; nothing more we can do
        finally:
            self._writer.close()

    def close(self) -> None:
        self._writer.close()


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
) -> Delivery:
    """Run one job on one worker. Raises WorkerBusy, JobRejected, JobFailed, JobTimeout, ProtocolError, NetworkError."""
    _, reader, writer = await open_stream(p2p, worker_id, maddrs, job_protocol(network))
    try:
        submit = {
            "t": "submit", "job": job_id, "program": program_hash, "inputs_size": len(inputs),
            "timeout": float(timeout), "max_price": max_price,
        }
        inline = len(inputs) <= INLINE_BYTES
        if inline:
            submit["inputs"] = inputs
        started = time.perf_counter()
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
            outputs = bytes(await read_payload(reader, size, MAX_OUTPUT_BYTES, "outputs"))
            transfer_seconds += time.perf_counter() - t0
        elif not isinstance(outputs, bytes) or len(outputs) != size:
            raise ProtocolError("inline outputs do not match their declared size")
        receipt = Receipt.from_bytes(field(frame, "receipt", bytes))
        del started
        return Delivery(outputs, receipt, sent, transfer_seconds, writer)
    except BaseException:
        writer.close()
        raise


async def ping(p2p, network: str, worker_id: str, payload: bytes = b"") -> dict:
    """One unary round trip to a worker: its clock and our payload echoed back."""
    import msgpack

    reply = await p2p._client.call_unary_handler(PeerID.from_base58(worker_id), ping_protocol(network), payload)
    return msgpack.unpackb(reply, raw=False)


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
