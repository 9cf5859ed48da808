"""How messages and bytes cross: a unary body is one msgpack map whose ``"t"`` names the message (hivemind caps it at
4 MiB); on a stream a *frame* is a 4-byte big-endian length then such a map, at most 64 KiB; a *payload* is raw bytes
whose size a preceding frame declared, checked against the reader's cap before anything is allocated and read in
1 MiB chunks, each within :data:`FRAME_TIMEOUT` and at :data:`MIN_PAYLOAD_RATE` overall.

Nothing read from the wire is ever unpickled or evaluated; every container is bounded before it is parsed; whatever
goes wrong (bad msgpack, an unknown or unexpected message, a parser's own bug, a broken or stalled stream) reads as
one :class:`~gpunet.errors.ProtocolError`.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Callable, Iterable, TypeVar

import msgpack

from gpunet.errors import GpunetError, ProtocolError, StreamBroken
from gpunet.protocol.fields import MESSAGES, M, Message
from gpunet.protocol.jobs import MAX_SETTLE_ITEMS
from gpunet.utils import human_bytes

MAX_FRAME_BYTES = 64 * 1024
CHUNK_BYTES = 1 << 20
#: A stream peer must send its next frame within this many seconds (a stalled peer must not hold a job slot).
FRAME_TIMEOUT = 10.0
#: ...and a payload at no less than this rate, beyond the frame timeout.
MIN_PAYLOAD_RATE = 1 << 20
_LEN = struct.Struct(">I")
T = TypeVar("T")


def encode(message: Message) -> bytes:
    """A unary message body."""
    return msgpack.packb(message.to_wire(), use_bin_type=True)


def decode(data: bytes, *expect: type[M]) -> M:
    """Parse a message; ProtocolError unless it is well formed and one of ``expect`` (any type when none given)."""
    try:  # container sizes capped too: a small body of many tiny arrays must not cost a second of parsing
        d = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=MAX_SETTLE_ITEMS,
                            max_map_len=256, max_str_len=MAX_FRAME_BYTES, max_bin_len=len(data))
    except Exception as e:  # msgpack raises several unrelated exception types on malformed input
        raise ProtocolError(f"message is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(d, dict) or not isinstance(d.get("t"), str):
        raise ProtocolError("message is not a map with a type")
    kind = MESSAGES.get(d["t"])
    if kind is None or (expect and kind not in expect):
        wanted = "/".join(k.T for k in expect) or "a known message"
        raise ProtocolError(f"expected {wanted}, got {d['t'][:32]!r}")
    try:
        return kind.from_wire(d)
    except GpunetError:
        raise
    except Exception as e:  # a parser bug must still read as a peer's bad message, never crash a handler
        raise ProtocolError(f"malformed {kind.T!r} message ({type(e).__name__})") from None


def encode_frame(message: Message) -> bytes:
    body = encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LEN.pack(len(body)) + body


def pack(items: Iterable[T], size: Callable[[T], int], room: int, most: int,
         alone: Callable[[T], bool] = lambda item: False) -> list[list[T]]:
    """``items`` in order, in runs that each go as one group frame: at most ``most`` items and ``room`` bytes (by
    ``size``) a run; an item bigger than ``room``, or one ``alone`` says goes by itself, is a run of its own."""
    runs: list[list[T]] = []
    left = 0
    for item in items:
        n = size(item)
        if alone(item):
            runs.append([item])
            left = 0
            continue
        if not runs or n > left or len(runs[-1]) >= most:
            runs.append([])
            left = room
        runs[-1].append(item)
        left -= n
    return runs


async def write(writer: asyncio.StreamWriter, message: Message) -> None:
    try:
        writer.write(encode_frame(message))
        await writer.drain()
    except (ConnectionError, OSError) as e:
        raise StreamBroken(f"stream broke: {e}") from None


async def read(reader: asyncio.StreamReader, *expect: type[M], timeout: float | None = None,
               idle: float | None = None) -> M:
    """Read one frame; ProtocolError on EOF, oversize, bad msgpack, an unexpected type, or ``timeout`` seconds of
    silence (a stalled peer must not hold what it holds forever). ``idle``: a stream kept open between exchanges may
    wait that long for a frame to begin, and the frame must then come whole within ``timeout``."""
    waited = timeout if idle is None else idle
    try:
        async with asyncio.timeout(waited):
            (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if size > MAX_FRAME_BYTES:
                raise ProtocolError(f"peer announced a {size}-byte frame; the cap is {MAX_FRAME_BYTES}")
            if idle is None:
                body = await reader.readexactly(size)
        if idle is not None:
            waited = timeout
            async with asyncio.timeout(timeout):
                body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise StreamBroken("peer closed the stream mid-message") from None
    except TimeoutError:
        raise ProtocolError(f"peer sent nothing for {waited:.0f} s") from None
    except (ConnectionError, OSError) as e:
        raise StreamBroken(f"stream broke: {e}") from None
    return decode(body, *expect)


def payload_deadline(size: int) -> float:
    return FRAME_TIMEOUT + size / MIN_PAYLOAD_RATE


async def write_payload(writer: asyncio.StreamWriter, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    try:
        for offset in range(0, len(view), CHUNK_BYTES):
            writer.write(view[offset : offset + CHUNK_BYTES])
            await writer.drain()
    except (ConnectionError, OSError) as e:
        raise ProtocolError(f"stream broke while writing: {e}") from None


def check_payload_size(size: Any, cap: int, what: str) -> None:
    """A declared payload size, checked before anything is allocated or charged for it."""
    if type(size) is not int or size < 0:
        raise ProtocolError(f"{what} size must be a non-negative integer")
    if size > cap:
        raise ProtocolError(f"{what} of {size} bytes ({human_bytes(size)}) exceeds this peer's limit of "
                            f"{human_bytes(cap)}")


async def read_payload(reader: asyncio.StreamReader, size: Any, cap: int, what: str, hasher=None,
                       timeout: float | None = None, into=None) -> bytearray | None:
    """Read exactly ``size`` declared bytes, refusing sizes over ``cap`` before allocating anything.

    ``hasher`` (a hashlib object) is fed each chunk as it arrives, so hashing overlaps the transfer. ``timeout``
    bounds the whole read (see :func:`payload_deadline`). ``into``: a binary file the bytes are written to instead
    (None is returned): a big payload then lives in the page cache, not in this process's heap.
    """
    check_payload_size(size, cap, what)
    # Grown as bytes arrive (amortised doubling), so a declared size costs memory only once it is actually sent.
    buf = bytearray()
    offset = 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(timeout):
            while offset < size:
                # Progress, not just a deadline: every chunk within FRAME_TIMEOUT, and at MIN_PAYLOAD_RATE overall once
                # past that grace, so a declared size cannot hold a job slot open without the bytes coming.
                async with asyncio.timeout(FRAME_TIMEOUT):
                    chunk = await reader.read(min(CHUNK_BYTES, size - offset))
                if not chunk:
                    raise ProtocolError(f"peer closed the stream after {offset} of {size} {what} bytes")
                if into is None:
                    buf += chunk
                else:
                    into.write(chunk)
                offset += len(chunk)
                if hasher is not None:
                    hasher.update(chunk)
                elapsed = loop.time() - started
                if offset < size and offset < (elapsed - FRAME_TIMEOUT) * MIN_PAYLOAD_RATE:
                    raise ProtocolError(f"{what} arrives too slowly ({offset} of {size} bytes in {elapsed:.0f} s)")
    except TimeoutError:
        buf.clear()  # the exception's traceback keeps this frame alive: free its buffer now
        raise ProtocolError(f"{what} arrived too slowly ({offset} of {size} bytes)") from None
    except (ConnectionError, OSError) as e:
        buf.clear()
        raise ProtocolError(f"stream broke while reading {what}: {e}") from None
    except BaseException:
        buf.clear()
        raise
    if into is not None:
        into.flush()
        return None
    return buf
