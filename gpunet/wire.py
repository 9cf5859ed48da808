"""The job protocol's framing, shared by worker and client: msgpack control frames and raw, capped payloads.

Jobs travel over libp2p streams (hivemind's binary stream handlers), not unary RPCs, so payloads of any size stream
in chunks and never meet the daemon's 4 MiB message limit. On a stream:

* a **frame** is a 4-byte big-endian length then a msgpack map with a ``"t"`` (type) key, at most 64 KiB;
* a **payload** (program, inputs, outputs) is raw bytes whose size a preceding frame declared; the reader checks the
  declared size against its cap *before* allocating, then reads it in 1 MiB chunks.

Nothing read from the wire is ever unpickled or evaluated.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

from gpunet.errors import (
    GpunetError,
    JobFailed,
    JobRejected,
    JobTimeout,
    ProgramNotCached,
    ProtocolError,
    WorkerBusy,
)

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024
CHUNK_BYTES = 1 << 20
#: Inputs and outputs at most this big ride inside a control frame (or a unary message), saving a round trip.
INLINE_BYTES = 32 * 1024
#: A stream peer must send its next frame within this many seconds (a stalled peer must not hold a job slot).
FRAME_TIMEOUT = 10.0
#: ...and a payload at no less than this rate, beyond the frame timeout.
MIN_PAYLOAD_RATE = 1 << 20
_LEN = struct.Struct(">I")


def job_protocol(network: str) -> str:
    return f"/gpunet/{network}/job/{PROTOCOL_VERSION}"


def info_protocol(network: str) -> str:
    return f"/gpunet/{network}/info/{PROTOCOL_VERSION}"


def ping_protocol(network: str) -> str:
    """A unary (request/response) echo: a liveness and clock probe, and the raw-RPC baseline in benchmarks."""
    return f"/gpunet/{network}/ping/{PROTOCOL_VERSION}"


MAX_PING_BYTES = 4096
#: Unary replies ride hivemind's persistent daemon connection, whose messages are capped at 4 MiB.
UNARY_OUTPUT_BYTES = 1 << 20


def run_protocol(network: str) -> str:
    """Unary job submission: one round trip for small jobs whose program the worker already holds."""
    return f"/gpunet/{network}/run/{PROTOCOL_VERSION}"


def settle_protocol(network: str) -> str:
    """Unary countersignature (or refusal) of a receipt delivered through the unary door."""
    return f"/gpunet/{network}/settle/{PROTOCOL_VERSION}"


def cancel_protocol(network: str) -> str:
    """Unary: stop a job this client submitted (queued or running). A stream job is cancelled by closing its stream."""
    return f"/gpunet/{network}/cancel/{PROTOCOL_VERSION}"


def pack(obj: dict[str, Any]) -> bytes:
    """A unary message body (hivemind's persistent connection caps it at 4 MiB)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, expect: str | tuple[str, ...] | None = None) -> dict[str, Any]:
    """Parse a unary message; ProtocolError unless it is a map whose type is expected."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types on malformed input
        raise ProtocolError(f"message is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise ProtocolError("message is not a map with a type")
    if expect is not None and obj["t"] not in ((expect,) if isinstance(expect, str) else expect):
        raise ProtocolError(f"expected {expect!r}, got {obj['t'][:32]!r}")
    return obj


def payload_deadline(size: int) -> float:
    return FRAME_TIMEOUT + size / MIN_PAYLOAD_RATE


def encode_frame(obj: dict[str, Any]) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LEN.pack(len(body)) + body


async def write_frame(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    writer.write(encode_frame(obj))
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, expect: str | tuple[str, ...] | None = None) -> dict[str, Any]:
    """Read one control frame; raises ProtocolError on EOF, oversize, bad msgpack, or an unexpected type."""
    try:
        (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if size > MAX_FRAME_BYTES:
            raise ProtocolError(f"peer announced a {size}-byte frame; the cap is {MAX_FRAME_BYTES}")
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ProtocolError("peer closed the stream mid-message") from None
    except (ConnectionError, OSError) as e:
        raise ProtocolError(f"stream broke: {e}") from None
    return unpack(body, expect)


async def write_payload(writer: asyncio.StreamWriter, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    for offset in range(0, len(view), CHUNK_BYTES):
        writer.write(view[offset : offset + CHUNK_BYTES])
        await writer.drain()


async def read_payload(reader: asyncio.StreamReader, size: Any, cap: int, what: str, hasher=None) -> bytearray:
    """Read exactly ``size`` declared bytes, refusing sizes over ``cap`` before allocating anything.

    ``hasher`` (a hashlib object) is fed each chunk as it arrives, so hashing overlaps the transfer.
    """
    if type(size) is not int or size < 0:
        raise ProtocolError(f"{what} size must be a non-negative integer")
    if size > cap:
        raise ProtocolError(f"{what} of {size} bytes exceeds this peer's limit of {cap} bytes")
    # Grown as bytes arrive (amortised doubling), so a declared size costs memory only once it is actually sent.
    buf = bytearray()
    offset = 0
    try:
        while offset < size:
            chunk = await reader.read(min(CHUNK_BYTES, size - offset))
            if not chunk:
                raise ProtocolError(f"peer closed the stream after {offset} of {size} {what} bytes")
            buf += chunk
            offset += len(chunk)
            if hasher is not None:
                hasher.update(chunk)
    except (ConnectionError, OSError) as e:
        raise ProtocolError(f"stream broke while reading {what}: {e}") from None
    return buf


def field(frame: dict[str, Any], name: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    """A frame field of the expected type (bool is never accepted as int)."""
    value = frame.get(name)
    if value is None and optional:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(f"frame {frame.get('t')!r}: field {name!r} must be {'/'.join(k.__name__ for k in kinds)}")
    return value


# --- errors across the wire: a code in an ``error`` frame, the same exception on both sides ---------------------------

_CODES: dict[str, type[GpunetError]] = {
    "busy": WorkerBusy,
    "rejected": JobRejected,
    "failed": JobFailed,
    "timeout": JobTimeout,
    "protocol": ProtocolError,
    "not_cached": ProgramNotCached,
}


def error_frame(error: GpunetError, **extra: Any) -> dict[str, Any]:
    """The frame that carries ``error`` to the peer (first matching family wins)."""
    code = next((c for c, kind in _CODES.items() if isinstance(error, kind)), "failed")
    return {"t": "error", "code": code, "message": str(error)[:2000], **extra}


def error_from_frame(frame: dict[str, Any]) -> GpunetError:
    """The exception an ``error`` frame stands for; unknown codes become JobFailed."""
    message = str(frame.get("message", ""))[:2000] or "worker reported an error"
    code = frame.get("code")
    if code == "busy":
        queue = frame.get("queue")
        return WorkerBusy(message, queue if type(queue) is int else 0)
    if code == "rejected":
        return JobRejected(message)
    if code == "not_cached":
        program = frame.get("program")
        return ProgramNotCached(program if isinstance(program, str) else "?")
    return _CODES.get(code, JobFailed)(message)
