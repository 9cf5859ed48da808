"""The job protocol's framing and error mapping, without a network."""

import asyncio

import pytest

from gpunet.errors import (
    JobFailed,
    JobRejected,
    JobTimeout,
    ProgramNotCached,
    ProtocolError,
    WorkerBusy,
)
from gpunet.wire import (
    MAX_FRAME_BYTES,
    encode_frame,
    error_frame,
    error_from_frame,
    read_frame,
    read_payload,
)


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


@pytest.mark.parametrize("error", [WorkerBusy("full", 3), JobRejected("op aten.from_file"), JobFailed("boom"),
                                   JobTimeout("slow"), ProtocolError("bad"), ProgramNotCached("ab" * 32)])
def test_errors_cross_the_wire_as_the_same_family(error):
    extra = {"program": error.program_hash} if isinstance(error, ProgramNotCached) else {}
    back = error_from_frame(error_frame(error, **extra))
    assert type(back) is type(error)
    if isinstance(error, ProgramNotCached):
        assert back.program_hash == error.program_hash


def test_frames_round_trip_and_bad_frames_are_protocol_errors():
    async def go():
        assert (await read_frame(_reader(encode_frame({"t": "info", "x": 1}))))["x"] == 1
        for raw in [b"", b"\x00\x00", (MAX_FRAME_BYTES + 1).to_bytes(4, "big"), b"\x00\x00\x00\x01\xc1",
                    b"\x00\x00\x00\x01\x01", encode_frame({"t": "other"})]:
            with pytest.raises(ProtocolError):
                await read_frame(_reader(raw), expect="info")

    asyncio.run(go())


def test_payload_sizes_are_checked_before_reading_and_buffers_grow_with_the_data():
    async def go():
        assert await read_payload(_reader(b"abc"), 3, 10, "x") == b"abc"
        with pytest.raises(ProtocolError, match="exceeds"):
            await read_payload(_reader(b""), 11, 10, "x")
        with pytest.raises(ProtocolError, match="non-negative"):
            await read_payload(_reader(b""), -1, 10, "x")
        with pytest.raises(ProtocolError, match="after 2 of 2000000000"):
            await read_payload(_reader(b"ab"), 2_000_000_000, 4_000_000_000, "x")  # no 2 GB allocated for it

    asyncio.run(go())
